"""A pool's shape, as the controller weighs and changes it (:mod:`proxy.control.shape` prices it).

:meth:`Reshaping.due` gathers what a look reads, once per ``plan_interval_s`` while every managed
worker serves one shape: the pool's recent requests (every worker's), one worker's decode lines and
KV pool (the twin's calibration), the engine's placement flags per tp. :func:`run_shapes` prices the
shapes off the event loop. :meth:`Reshaping.decide` journals the comparison (rule ``reshape``: each
shape's predicted throughput, the best, its predicted gain). A reshape pays where the best shape
gains ``RESHAPE_MIN_GAIN`` or more while work waits for the pool, on ``plan_confirmations`` looks in
a row; ``auto`` with the pool's ``reshape = true`` carries it out, else it is advised.

The rollout (:meth:`Reshaping.carry_out`), group by group: a group is the GPUs of the larger of the
old and the new tp (one tp-8 worker and eight tp-1 are one group; two tp-4 into four tp-2 are two).
Its old workers are drained as for a restart (what they run finishes or goes back to the proxy's
queue: nothing is lost), then the new shape's workers start on the freed GPUs. The first group is
the canary: where old workers still serve beside it, its tokens per GPU must match theirs once it
has served ``min_evidence_s``, else it is turned back into the old shape and the reshape ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from proxy.control.decision import Action, Decision, RuleKind
from proxy.control.evidence import OPTIONAL, Evidence
from proxy.control.journal import Status
from proxy.control.phase import Tracked
from proxy.control.planning import decode_stats, kv_capacity
from proxy.control.ports import Act, Drain, Surroundings
from proxy.control.roster import Roster
from proxy.control.shape import TP_SIZES, Shape, ShapeComparison, compare_shapes, shape_args, shapes_for
from proxy.control.twin import DecodeStats, Twin, calibrate
from proxy.control.workload import Observed
from proxy.policy import ControlMode
from proxy.sim.twin import TP_ARG
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState

__all__ = ["RESHAPE_MIN_GAIN", "Reshaper", "Reshaping", "ShapeInputs", "ShapeJob", "run_shapes"]

_log = logging.getLogger(__name__)

# a reshape restarts every worker of the pool, and the twin's tensor parallel costs are assumed, not
# measured on the GPUs: a gain is acted on only well beyond a plan's
RESHAPE_MIN_GAIN = 0.10


@runtime_checkable
class Reshaper(Protocol):
    """The rollout's reshape step (:meth:`proxy.control.rollout.Rollout.reshape_step`)."""

    async def reshape_step(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> tuple[list[WorkerInfo], list[Drain]]: ...

    def gpus_of(self, worker_id: WorkerId) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeInputs:
    """What one look prices (collected on the event loop, priced off it)."""

    gpu: str
    model: str
    args: Mapping[str, object]
    decode: tuple[DecodeStats, ...]
    kv_capacity_tokens: int | None
    workload: tuple[Observed, ...]
    current: Shape
    tp_args: Mapping[int, Mapping[str, object]]
    fresh: Mapping[str, object]  # what another shape's workers start from (:func:`fresh_args`)


def run_shapes(inputs: ShapeInputs) -> ShapeComparison | None:
    """Calibrate the twin on one worker's lines, then price every shape (CPU-bound: one replay each)."""
    twin = calibrate(inputs.gpu, inputs.model, inputs.args, inputs.decode, inputs.kv_capacity_tokens)
    return compare_shapes(twin, inputs.args, inputs.workload, inputs.current, inputs.tp_args, fresh=inputs.fresh)


@dataclass(frozen=True, slots=True)
class ShapeJob:
    time: float
    inputs: ShapeInputs
    workers: tuple[WorkerId, ...]
    work_waits: bool  # work waited for the pool at the look (its proxy queue, or a worker's backlog)
    measured: float | None  # the pool's output tokens per second over its windows


@dataclass(frozen=True, slots=True, kw_only=True)
class Reshape(Evidence):
    current_shape: str
    best_shape: str
    predicted_current: float
    predicted_best: float
    measured_throughput: float | None = field(default=None, metadata=OPTIONAL)
    work_waits: bool
    replayed_requests: int


def fresh_args(args: Mapping[str, object], initial: Mapping[str, object], memory_fraction: str) -> dict[str, object]:
    """A worker's arguments for another shape: its own, the memory fraction as the policy gave it (unset:
    the engine's default). The fraction the rules tuned to this shape's free memory at start-up does
    not carry over: one GPU's free memory at tp 1 is not tp GPUs' at tp (a tp-2 worker's 13 GB free at
    0.913 left a tp-1 worker 3.4 GB)."""
    out = dict(args)
    if memory_fraction in initial:
        out[memory_fraction] = initial[memory_fraction]
    else:
        out.pop(memory_fraction, None)
    return out


def tp_of(args: Mapping[str, object]) -> int:
    value = args.get(TP_ARG, 1)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1


@dataclass(slots=True)
class _Looks:
    last: float = float("-inf")
    paying: int = 0  # looks in a row naming the same better shape
    shape: Shape | None = None
    reshaped: float = float("-inf")  # the last reshape's end: none again within ``flip_guard_s``


class Reshaping:
    """The pool's shape: its looks, their journal entries, and the reshape's rollout."""

    def __init__(
        self,
        roster: Roster,
        surroundings: Surroundings,
        twin: Callable[[Mapping[str, object]], Twin],
        placement: Callable[[int], Mapping[str, object]] | None,
        track: Callable[[WorkerInfo], None],
        *,
        twin_models_engine: bool,
    ) -> None:
        self._roster = roster
        self._track = track
        self._surroundings = surroundings
        self._twin = twin
        self._placement = placement
        self._twin_models_engine = twin_models_engine
        self._looks = _Looks()
        self.under_way = False

    @property
    def pending(self) -> bool:
        """A reshape paid on the latest look and will be carried out where the next one confirms it
        (``auto``, the pool's ``reshape``): a worker's own plan waits for it, as the reshape replaces it."""
        roster = self._roster
        return self._looks.shape is not None and roster.mode is ControlMode.AUTO and roster.settings.reshape

    def current(self) -> tuple[Shape, list[Tracked]] | None:
        """The pool's shape: every managed worker at one tp (None: none, or a reshape left it mixed)."""
        managed = sorted(self._roster.managed(), key=lambda w: w.state.worker_id)
        tps = {tp_of(w.state.args) for w in managed}
        if not managed or len(tps) != 1:
            return None
        return Shape(tps.pop(), len(managed)), managed

    def due(self) -> ShapeJob | None:
        """A look, when one is due: ``plan_interval_s`` since the last, every managed worker serving with
        ``min_evidence_s`` of evidence, answered requests to replay, and a shape besides the current."""
        roster, c = self._roster, self._roster.constants
        if roster.mode is ControlMode.OFF or self._placement is None or not self._twin_models_engine:
            return None
        now = roster.clock()
        if self.under_way or now - self._looks.last < c.plan_interval_s:
            return None
        found = self.current()
        if found is None or len(shapes_for(found[0].gpus)) < 2:
            return None
        shape, managed = found
        # serving, a plan of its own being computed or not (one worker's plan is often under way in a fleet)
        if any(not w.phase.serving or w.window.observed_s < c.min_evidence_s for w in managed):
            return None
        workload = tuple(o for w in managed for o in self._surroundings.recent_requests(w.state.worker_id))
        if not workload:
            return None
        self._looks.last = now
        first = managed[0]
        args = dict(first.state.args)
        twin = self._twin(args)
        tp_args = {tp: dict(self._placement(tp)) for tp in TP_SIZES if shape.gpus % tp == 0}
        fresh = fresh_args(args, first.state.initial_args, twin.names.memory_fraction)
        inputs = ShapeInputs(gpu=twin.gpu, model=twin.model, args=args, decode=decode_stats(first.window),
                             kv_capacity_tokens=kv_capacity(first.window), workload=workload, current=shape,
                             tp_args=tp_args, fresh=fresh)  # fmt: skip
        waits = self._surroundings.backlog() > 0 or any(w.backlog.since is not None for w in managed)
        rates = [w.window.throughput for w in managed]
        measured = sum(r for r in rates if r is not None) if all(r is not None for r in rates) else None
        return ShapeJob(now, inputs, tuple(w.state.worker_id for w in managed), waits, measured)

    def decide(self, job: ShapeJob, comparison: ShapeComparison | None) -> Act | None:
        """Journal the look (noted, advised, or acting) and return the reshape to carry out, if any."""
        roster = self._roster
        found = self.current()
        if comparison is None or found is None or tuple(w.state.worker_id for w in found[1]) != job.workers:
            return None  # nothing priced, or the pool changed while it was
        now = roster.clock()
        best, gain = comparison.best, comparison.gain
        better = best.shape != comparison.current.shape
        pays = better and gain >= RESHAPE_MIN_GAIN and job.work_waits
        looks = self._looks
        looks.paying = looks.paying + 1 if pays and looks.shape == best.shape else int(pays)
        looks.shape = best.shape if pays else None
        old = dict(job.inputs.args)
        new = shape_args(
            job.inputs.fresh, comparison.current.shape.tp, best.shape.tp, job.inputs.tp_args[best.shape.tp]
        )
        decision = Decision(worker_id=job.workers[0], rule="reshape", reason=_reason(comparison, job, pays),
                            time=now, evidence=_evidence(comparison, job), old_args=old, new_args=new,
                            kind=RuleKind.TUNING, action=Action.RESTART if pays else Action.NOTE)  # fmt: skip
        extra = comparison.to_json()
        w = roster.workers[job.workers[0]]
        acts = roster.mode is ControlMode.AUTO and roster.settings.reshape
        guarded = now - looks.reshaped < roster.constants.flip_guard_s
        if not pays or not acts or guarded or looks.paying < roster.constants.plan_confirmations:
            status = Status.ADVISED if pays and not acts else Status.NOTED
            detail = _not_acted(roster) if pays and not acts else ""
            if pays and acts and guarded:
                detail = f"the pool was reshaped under flip_guard_s ({roster.constants.flip_guard_s:g} s) ago"
            # the shape it has serving the most is said once per flip guard, another shape once per cool-down
            span = None if better else roster.constants.flip_guard_s
            roster.journal_once(w, decision, f"reshape:{best.shape}:{pays}", now, status=status, detail=detail,
                                span=span, extra=extra)  # fmt: skip
            return None
        self.under_way = True
        entry_id = roster.journal.record(decision, mode=roster.mode, status=Status.ACTING,
                                         before=w.window.summary(), extra=extra)  # fmt: skip
        return Act(decision=decision, entry_id=entry_id)

    async def carry_out(self, act: Act, reshaper: Reshaper) -> None:
        """The rollout, group by group, the first the canary (the module's docstring); journaled."""
        roster = self._roster
        try:
            done = await self._roll(act, reshaper)
        except asyncio.CancelledError:
            roster.journal.update(act.entry_id, status=Status.FAILED, detail="cancelled (the proxy is stopping)")
            raise
        except Exception as exc:
            _log.warning("reshape failed: %s", exc)
            roster.journal.update(act.entry_id, status=Status.FAILED, detail=f"{exc.__class__.__name__}: {exc}")
            return
        finally:
            self.under_way = False
            self._looks = _Looks(last=roster.clock(), reshaped=roster.clock())
        status, detail, steps = done
        roster.journal.update(act.entry_id, status=status, detail=detail, act={"steps": steps})

    async def _roll(self, act: Act, reshaper: Reshaper) -> tuple[Status, str, list[dict[str, object]]]:
        d = act.decision
        old_tp, new_tp = tp_of(d.old_args), tp_of(d.new_args)
        found = self.current()
        if found is None:
            return Status.FAILED, "the pool's shape changed before the reshape began", []
        olds = sorted((w.state.worker_id for w in found[1]), key=lambda wid: (reshaper.gpus_of(wid), wid))
        size = max(old_tp, new_tp)
        per_old, per_new = size // old_tp, size // new_tp
        groups = [olds[i : i + per_old] for i in range(0, len(olds), per_old)]
        steps: list[dict[str, object]] = []
        for k, group in enumerate(groups):
            infos, drains = await reshaper.reshape_step(group, per_new, d.new_args, d.reason)
            self._retrack(group, infos)
            steps.append({"old": group, "new": [i.id for i in infos], "drains": [x.to_json() for x in drains]})
            down = [i.id for i in infos if i.state is not WorkerState.READY]
            if down:
                return Status.FAILED, f"the new shape's {', '.join(down)} did not come up", steps
            if k == 0 and len(groups) > 1:
                verdict = await self._canary([i.id for i in infos], new_tp, groups[1:], old_tp)
                steps[-1]["canary"] = verdict
                if not verdict["promoted"]:
                    canary = [i.id for i in infos]
                    back, undone = await reshaper.reshape_step(canary, len(group), d.old_args,
                                                               "reshape's canary reverted")  # fmt: skip
                    self._retrack(canary, back)
                    steps.append({"old": canary, "new": [i.id for i in back], "drains": [x.to_json() for x in undone],
                                  "reverted": True})  # fmt: skip
                    return Status.FAILED, "the canary served less per GPU than the old shape: reverted", steps
        return Status.APPLIED, f"the pool is {len(groups) * per_new} x tp {new_tp}", steps

    def _retrack(self, gone: Sequence[WorkerId], infos: Sequence[WorkerInfo]) -> None:
        """The workers a step stopped are forgotten; the new ones followed (a reused id afresh: its
        window and state are of its new shape)."""
        for worker_id in gone:
            self._roster.workers.pop(worker_id, None)
        for info in infos:
            self._track(info)

    async def _canary(
        self, new: Sequence[WorkerId], new_tp: int, rest: Sequence[Sequence[WorkerId]], old_tp: int
    ) -> dict[str, object]:
        """Wait until the canary's workers have served ``min_evidence_s`` (at most ``window_s`` more), then
        compare its output tokens per GPU with the old workers' beside it."""
        roster, c = self._roster, self._roster.constants
        olds = [wid for group in rest for wid in group]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + c.min_evidence_s + c.window_s
        while loop.time() < deadline:
            ws = [roster.workers.get(wid) for wid in new]
            if all(w is not None and w.window.observed_s >= c.min_evidence_s for w in ws):
                break
            await asyncio.sleep(c.interval_s)
        mine = _per_gpu(roster, new, new_tp)
        theirs = _per_gpu(roster, olds, old_tp)
        promoted = mine is not None and theirs is not None and mine >= theirs
        return {"per_gpu": mine, "old_per_gpu": theirs, "promoted": promoted}


def _per_gpu(roster: Roster, workers: Sequence[WorkerId], tp: int) -> float | None:
    rates = [roster.workers[wid].window.throughput if wid in roster.workers else None for wid in workers]
    if not rates or any(r is None for r in rates):
        return None
    return round(sum(r for r in rates if r is not None) / (tp * len(rates)), 2)


def _evidence(comparison: ShapeComparison, job: ShapeJob) -> Reshape:
    return Reshape(
        current_shape=str(comparison.current.shape),
        best_shape=str(comparison.best.shape),
        predicted_current=round(comparison.current.output_tok_per_s, 1),
        predicted_best=round(comparison.best.output_tok_per_s, 1),
        measured_throughput=None if job.measured is None else round(job.measured, 1),
        work_waits=job.work_waits,
        replayed_requests=comparison.replayed_requests,
    )


def _reason(comparison: ShapeComparison, job: ShapeJob, pays: bool) -> str:
    now, best = comparison.current, comparison.best
    figures = "; ".join(f"{r.shape}: {r.output_tok_per_s:.0f} tok/s" if r.unfit is None else f"{r.shape}: {r.unfit}"
                        for r in comparison.results)  # fmt: skip
    if best.shape == now.shape:
        head = f"{now.shape} serves the most of the pool's shapes"
    else:
        head = f"{best.shape} would serve {comparison.gain:+.0%} over {now.shape}"
    if best.shape != now.shape and not pays:
        head += (" (under the reshape's threshold)" if comparison.gain < RESHAPE_MIN_GAIN
                 else " (no work waits for the pool: its shape gains nothing now)")  # fmt: skip
    return f"{head}, the twin's saturated throughput on the pool's {comparison.replayed_requests} newest requests: {figures}"


def _not_acted(roster: Roster) -> str:
    if roster.mode is not ControlMode.AUTO:
        return f"control.mode = {roster.mode}"
    return "the pool's control.reshape is false"
