"""A change tried on one worker of several: a planner's canary, or an operator's trial.

Where two or more managed workers serve, a plan's new arguments go to one worker first (the canary);
an operator's trial (``POST /admin/trial``) is one too, on the worker and arguments it names. Once the
canary has served a window with them, its share of the others' throughput is judged
(:func:`~proxy.control.canary.judge`): promoted (rolled out to the others, one at a time), kept on
it alone, or reverted; a canary clearly failing is reverted before its window is in. One canary at
a time, and no other restart while one is judged: :meth:`Trials.restart_under_way` says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from proxy.control.canary import Canary, CanaryVerdict, failing, judge, share
from proxy.control.decision import Decision, RuleKind
from proxy.control.journal import Status
from proxy.control.phase import Phase, Tracked
from proxy.control.ports import Act, TrialRefused
from proxy.control.roster import Roster
from proxy.policy import ControlMode
from proxy.workers.base import WorkerId, WorkerState

__all__ = ["Trials"]


class Trials:
    """The canary under way (if any) and its promotion's roll-out, over the roster's workers."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        self.canary: Canary | None = None  # a plan tried on one worker of several
        self._promote: list[WorkerId] = []  # workers still to take the promoted canary's args, in order

    def under_way(self) -> str | None:
        """Where a canary is being judged or its promotion rolled out (the fleet), or None."""
        if self.canary is not None:
            return self.canary.worker_id
        return "the fleet" if self._promote else None

    def restart_under_way(self, w: Tracked) -> tuple[str, str] | None:
        """What keeps ``w`` from restarting now (one restart at a time, a canary judged against the others):
        its journal key and words, or None."""
        if self._roster.down_besides(w):
            return "planner", "another worker is restarting or down: one at a time"
        where = self.under_way()
        if len(self._roster.managed()) >= 2 and where is not None:
            return "canary", f"a canary is under way on {where}"
        return None

    def share(self, w: Tracked, since: float = float("-inf")) -> float | None:
        """``w``'s output tokens/s over the window (from ``since`` on), as decoded, against the other serving
        managed workers' mean over the same time: those that had served a whole window before it began,
        where any did (one ready since is still refilling its batch and would flatter ``w``: in the fleet
        scenario a canary's share read 0.97 before its restart against a worker just reverted from an
        operator's bad trial, 0.64 in the arm without the trial, and the canary was promoted on it)."""
        k = self._roster.constants
        serving = [o for o in self._roster.managed() if o is not w and o.serving]
        begins = max(since, self._roster.clock() - k.window_s)
        settled = [o for o in serving if o.window.since <= begins - k.window_s]  # serving since
        others = [o.window.after(since).decode_rate for o in (settled or serving)]
        value = share(w.window.after(since).decode_rate, others)
        return None if value is None else round(value, 4)

    def begin(
        self,
        w: Tracked,
        entry_id: int,
        old: Mapping[str, object],
        new: Mapping[str, object],
        promote_above: float | None = None,
    ) -> None:
        """``w`` restarts with ``new`` as the canary (journaled under ``entry_id``), its share measured now."""
        self.canary = Canary(worker_id=w.state.worker_id, entry_id=entry_id, old_args=old, new_args=new,
                             before=self.share(w), promote_above=promote_above)  # fmt: skip

    def came_back(self, entry_id: int, opens: float | None) -> None:
        """The act journaled under ``entry_id`` ended: if it was the canary's, its evidence begins at
        ``opens`` (it serves with the new args), or (None: refused, or it did not come back) there is
        nothing to judge (a death's rules take over)."""
        if self.canary is None or self.canary.entry_id != entry_id:
            return
        self.canary = None if opens is None else replace(self.canary, opens=opens)

    def step(self, now: float, others_down: bool) -> Act | None:
        """Judge a canary whose window is in, or roll its promotion on by one worker."""
        if self._roster.mode is not ControlMode.AUTO:
            return None
        if self._promote and not others_down:
            return self._promote_next(now)
        canary = self.canary
        if canary is None or canary.opens is None or self._promote:
            return None
        w = self._roster.workers.get(canary.worker_id)
        if w is None:
            self.canary = None
            return None
        return self._judge(w, canary, canary.opens, now, others_down)

    def _promote_next(self, now: float) -> Act | None:
        """The promoted canary's args, rolled out to the next worker."""
        roster = self._roster
        wid = self._promote.pop(0)
        w = roster.workers.get(wid)
        canary = self.canary
        if w is None or canary is None or not w.serving:
            return None
        changed = {k: v for k, v in canary.new_args.items() if canary.old_args.get(k) != v}
        # its own plan, held back behind the canary, goes with it where it moves other arguments: in the fleet
        # scenario the roll-out reached w3 without its own fix (its running cap 64 -> 128), held back twice
        held = w.looks.held_back or {}
        own = {k: v for k, v in held.items() if k not in changed and w.state.args.get(k) != v}
        new_args = {**w.state.args, **changed, **own}
        if not self._promote:
            self.canary = None
        if new_args == dict(w.state.args):
            return None
        reason = f"the canary {canary.worker_id} beat the others with {changed}: rolled out here"
        if own:
            reason += f", with this worker's own plan held back behind it ({own})"
        decision = Decision(worker_id=wid, rule="canary_promote", time=now, old_args=dict(w.state.args),
                            new_args=new_args, kind=RuleKind.TUNING, reason=reason)  # fmt: skip
        entry_id = roster.journal.record(decision, mode=roster.mode, status=Status.ACTING, before=w.window.summary(),
                                         extra={"canary": canary.worker_id})  # fmt: skip
        w.move(Phase.ACTING)
        return Act(decision=decision, entry_id=entry_id)

    def _judge(self, w: Tracked, canary: Canary, opens: float, now: float, others_down: bool) -> Act | None:
        """The canary's verdict once its window (from ``opens``) is in, or it clearly fails: promote,
        keep or revert."""
        roster, k = self._roster, self._roster.constants
        if w.phase is Phase.ACTING or others_down or now < opens or w.window.after(opens).observed_s < k.min_evidence_s:
            return None  # judged against the others only while they all serve, once it has refilled
        after = self.share(w, since=opens)
        early = now < opens + k.window_s  # the whole window is not in yet
        if early and not failing(after, canary.before, k.canary_fail_below):
            return None
        verdict_ = judge(after, canary.before, k.canary_margin, canary.promote_above)
        if verdict_ is CanaryVerdict.WAIT:
            return None
        figures: dict[str, object] = {
            "canary_share_before": canary.before,
            "canary_share_after": round(after or 0.0, 4),
        }
        if canary.promote_above is not None:
            figures["canary_promotion_pays_above"] = round(canary.promote_above, 4)
        if early:
            figures["canary_failed_early_s"] = round(w.window.after(opens).observed_s, 1)  # before window_s was in
        roster.journal.update(canary.entry_id, fields={"canary_verdict": str(verdict_), **figures})
        if verdict_ is CanaryVerdict.PROMOTE:
            self._promote = [o.state.worker_id for o in roster.managed() if o is not w]
            return None
        self.canary = None
        if verdict_ is CanaryVerdict.KEEP:
            return None
        before = "not measured" if canary.before is None else f"{canary.before:.3f}"
        decision = Decision(worker_id=w.state.worker_id, rule="canary_revert", time=now, old_args=dict(w.state.args),
                            new_args=dict(canary.old_args), kind=RuleKind.CORRECTIVE,
                            reason=f"the canary served {after or 0.0:.3f} x the others' mean "
                                   f"throughput (before its restart: {before}): its old args back")  # fmt: skip
        entry_id = roster.journal.record(decision, mode=roster.mode, status=Status.ACTING, before=w.window.summary(),
                                         extra={"canary": w.state.worker_id, **figures})  # fmt: skip
        w.move(Phase.ACTING)
        return Act(decision=decision, entry_id=entry_id)

    def trial(self, worker_id: WorkerId, args: Mapping[str, object], *, note: str = "") -> Act:
        """An operator's trial: ``args`` (merged over the worker's own) tried on ``worker_id`` as a
        canary, journalled like a plan (reason "operator trial") and judged, promoted, kept or
        reverted by the same canary code. Returns the act to carry out (the caller starts it);
        raises :class:`~proxy.control.ports.TrialRefused` (in words) when it cannot start now."""
        roster = self._roster
        now = roster.clock()
        w = roster.workers.get(worker_id)
        if w is None:
            raise TrialRefused(f"no worker {worker_id!r} in this pool", code="unknown_worker")
        if roster.mode is not ControlMode.AUTO:
            raise TrialRefused(f"control mode is {roster.mode}: a trial restarts a worker, only in auto")
        if not w.managed:
            raise TrialRefused(f"worker {worker_id} is not managed by this proxy: it cannot be restarted")
        if len(roster.managed()) < 2:
            raise TrialRefused("a trial needs two or more managed workers: the canary is judged against the others")
        under_way = self.under_way()
        if under_way is not None:
            raise TrialRefused(f"a canary is under way on {under_way}: one at a time")
        busy = [
            wid
            for wid, o in roster.workers.items()
            if o.managed and (not o.serving or o.pool_state is not WorkerState.READY)
        ]
        if busy:
            raise TrialRefused(f"{', '.join(busy)} restarting or down: one at a time")
        old = dict(w.state.args)
        new = {**old, **args}
        if new == old:
            raise TrialRefused(f"worker {worker_id} already runs {dict(args)}", code="no_change")
        moved = {k: v for k, v in new.items() if old.get(k) != v}
        reason = "operator trial" + (f": {note}" if note else "") + f" of {moved}"
        decision = Decision(worker_id=worker_id, rule="operator_trial", reason=reason, time=now, old_args=old,
                            new_args=new, kind=RuleKind.TUNING)  # fmt: skip
        entry_id = roster.journal.record(decision, mode=roster.mode, status=Status.ACTING, before=w.window.summary(),
                                         extra={"canary": worker_id})  # fmt: skip
        self.begin(w, entry_id, old, new)
        w.move(Phase.ACTING)
        return Act(decision=decision, entry_id=entry_id)
