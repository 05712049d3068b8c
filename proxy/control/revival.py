"""A managed worker died: why, how often, and the arguments it comes back with.

The death's cause is read from the worker's window (an OOM or crash line the follower saw), else
from its log tail through the engine's own classification, else from how the pool says it ended.
The death rules (``rules.ON_DEATH``) may change the arguments it comes back with (an OOM's safer
ones); a revival waits a back-off that grows with the recent deaths, and a crash loop no rule can
break is journaled once per loop. ``off`` revives nothing; ``revive = false`` journals the advice.
"""

from __future__ import annotations

import logging

from proxy.control.decision import Decision, RuleKind
from proxy.control.evidence import Death
from proxy.control.journal import Status
from proxy.control.phase import Phase, Tracked
from proxy.control.ports import Act, EngineLogs, Surroundings
from proxy.control.roster import Roster
from proxy.control.rules import ON_DEATH, crash_loop_unbroken, evaluate, revive_delay
from proxy.engines.base import EventKind, LogEvent
from proxy.policy import ControlMode
from proxy.workers.base import WorkerId
from proxy.workers.exit_text import how_it_ended, shorten_cause

__all__ = ["Revival"]

_log = logging.getLogger(__name__)
_TAIL_LINES = 300
_DEATH_CHARS = 500  # a death's cause in words, at most (how it ended kept, what it said cut at its front: a dying process says why last)


class Revival:
    """Decides a dead worker's revival, over the roster's workers."""

    def __init__(self, roster: Roster, engine: EngineLogs, surroundings: Surroundings) -> None:
        self._roster = roster
        self._engine = engine
        self._surroundings = surroundings

    def decide(self, worker_id: WorkerId, exit_code: int | None = None, last_error: str | None = None) -> Act | None:
        """A managed worker died (``exit_code``: its process's, negative for a signal, where known;
        ``last_error``: the pool's words for it, how it ended and what it said last): classify,
        count, and choose the args it comes back with. A crash loop the ``crash_loop`` rule cannot
        break (it would go back to the args the worker runs) is journaled once per loop.

        Returns the revival to carry out (``auto``, or ``advise`` with the args it died with; both
        with ``revive``), else None: ``revive = false`` journals what it would do, ``off`` only
        records the death.
        """
        roster, k = self._roster, self._roster.constants
        now = roster.clock()
        w = roster.workers[worker_id]
        if w.reader is not None:
            for event in w.reader.flush(now):
                w.window = w.window.push(event)
        cause = self._death_cause(worker_id, w, now, exit_code, last_error)
        w.state = w.state.after_death(now)
        w.move(Phase.DOWN)
        if roster.mode is ControlMode.OFF:
            _log.warning(
                "worker %s died (%s): it stays down (control.mode = off restarts nothing; advise or auto revive it)",
                worker_id,
                cause,
            )
            return None
        delay = revive_delay(w.state, k, now)
        deaths = w.state.deaths_within(now, k.crash_loop_window_s)
        if deaths <= 1:  # the loop it was in, if any, is over: the death before left the window
            w.state = w.state.with_crash_loop_noted(False)
        chosen = evaluate(w.window.at(now), w.state, roster.rules, ON_DEATH).decision
        if chosen is not None:
            decision = Decision(
                worker_id=chosen.worker_id, rule=chosen.rule, reason=f"worker died ({cause}); {chosen.reason}", time=now,
                evidence=Death(rule=chosen.evidence, death=cause, deaths_in_window=deaths),
                old_args=chosen.old_args, new_args=chosen.new_args, kind=chosen.kind, change=chosen.change,
                delay_s=max(delay, chosen.delay_s),
            )  # fmt: skip
        else:
            decision = self._revival(worker_id, w, cause, deaths, now, delay)
        advice = None
        if not roster.settings.revive:
            advice = "the worker stays down (revive = false)"
        elif roster.mode is ControlMode.ADVISE and dict(decision.new_args) != dict(w.state.args):
            # advise changes no argument, but a dead worker is no advice: it comes back as it was,
            # and what a rule would change is journaled beside it
            advice = "advice (mode advise): the worker comes back with its own arguments"
        if advice is not None:
            roster.journal.record(
                decision, mode=roster.mode, status=Status.ADVISED, detail=advice, before=w.window.summary()
            )
            if not roster.settings.revive:
                return None
            decision = self._revival(worker_id, w, cause, deaths, now, decision.delay_s)
        # a loop on the same arguments only: a rule changing them (an OOM's) is no loop yet
        loop = crash_loop_unbroken(w.state, k, now, cause) if decision.rule == "revive" else None
        if loop is not None:
            _log.warning("worker %s: %s", worker_id, loop.reason)
            w.state = w.state.with_crash_loop_noted(True)
            roster.journal.record(loop, mode=roster.mode, status=Status.NOTED, before=w.window.summary())
        back_in = decision.delay_s
        _log.warning(
            "worker %s died (%s, death %d in %g s): %s %s",
            worker_id,
            cause,
            deaths,
            k.crash_loop_window_s,
            "restarting it" if decision.rule == "revive" else f"{decision.rule}: restarting it",
            f"in {back_in:g} s (crash back-off)" if back_in > 0 else "now",
        )
        entry_id = roster.journal.record(
            decision,
            mode=roster.mode,
            status=Status.ACTING,
            before=w.window.summary(),
            detail=f"back in {back_in:g} s (crash back-off), then the start-up" if back_in > 0 else "",
        )
        w.move(Phase.ACTING)
        return Act(decision=decision, entry_id=entry_id, revival=True)

    @staticmethod
    def _revival(worker_id: WorkerId, w: Tracked, cause: str, deaths: int, now: float, delay_s: float) -> Decision:
        """The worker back with the arguments it died with, after ``delay_s``."""
        return Decision(
            worker_id=worker_id, rule="revive", reason=f"worker died ({cause}); restarting it with the same args",
            time=now, evidence=Death(death=cause, deaths_in_window=deaths),
            old_args=w.state.args, new_args=w.state.args, kind=RuleKind.SAFETY, delay_s=delay_s,
        )  # fmt: skip

    def _death_cause(
        self, worker_id: WorkerId, w: Tracked, now: float, exit_code: int | None = None, last_error: str | None = None
    ) -> str:
        """In words, from the window's events; the log tail is read when the follower saw nothing;
        then the pool's words (how the process ended and what it said last), or how it ended."""
        oom, crash = w.window.last(EventKind.OOM), w.window.last(EventKind.CRASH)
        if oom is not None:
            return f"out of memory in {oom.fields.get('phase', 'unknown')}"
        if crash is not None:
            return f"crash: {crash.fields.get('exception') or crash.line.splitlines()[0][:160]}"
        death = self._engine.classify_death(self._surroundings.log_tail(worker_id, _TAIL_LINES))
        if death is None or death.cause == "unknown":
            if last_error:
                return shorten_cause(last_error, _DEATH_CHARS)
            return "exited" if exit_code is None else how_it_ended(exit_code)
        if death.cause == "oom":
            w.window = w.window.push(
                LogEvent(
                    kind=EventKind.OOM, time=now, fields={"phase": death.phase, "cause": "log_tail"}, line=death.detail
                )
            )
            return f"out of memory in {death.phase}"
        return f"{death.cause}: {death.detail}"[:200]
