"""The gain an output budget is predicted to bring: the planner's twin on the worker's recent requests.

When the fast tier sets or moves a class's output budget, the worker's twin is calibrated as for a
plan (:func:`~proxy.control.twin.calibrate`, on the worker's decode lines and the replay of its newest
answers) and replays those answers, with the traffic that follows them
(:func:`~proxy.control.workload.continued`), twice under the worker's current arguments: with the
class's requests asking for that ``max_tokens`` (its :class:`Cohort`) sent as they were sent before
the decision, and sent with the budget. An answer that reaches the budget is continued by the proxy;
the twin models it as the same whole answer sent as asked (it cannot send the rest again). The
cohort's requests open on the worker, their lengths not known yet, are sent with the budget where its
typical answer fits under it (as the planner's replay expects them). The predicted gain is the ratio
of the two throughputs: what the class's traffic gets once sent with the budget, not the passage to
it; the twin's error on the window as it went says how far it can be trusted (:func:`predict_budget`).
A budget lets SGLang admit what its reservation for ``max_tokens`` held back, past the batch its CUDA
graphs cover, where each decode step runs slower; so a third replay holds the worker at its graphs'
batch (:attr:`BudgetPrediction.held_tok_per_s`), and the controller holds it there only where that wins
(:meth:`BudgetPrediction.hold`). Pure and CPU-bound: it runs off the event loop, where plans run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from proxy.control.twin import DecodeStats, Prediction, Twin, calibrate
from proxy.control.workload import InFlight, Observed, continued, replay
from proxy.sim.config import SimConfigError
from proxy.sim.twin import graph_max_bs, running_cap

__all__ = ["BudgetInputs", "BudgetPrediction", "Cohort", "predict_budget"]


@dataclass(frozen=True, slots=True)
class Cohort:
    """The requests one budget applies to: a class's asking for ``asked`` tokens."""

    interactive: bool
    asked: int

    def sent(self, o: Observed, cap: int) -> Observed:
        """``o`` as the worker would have been asked for it with the cohort's ``max_tokens`` at ``cap``:
        one whose answer fits under ``cap`` goes with it; one that reaches it goes on in another part,
        modelled as the same whole answer, sent as asked. Another class's, or one asking for other, as it was."""
        if o.interactive is not self.interactive or o.asked != self.asked:
            return o
        return replace(o, max_tokens=cap if o.output_tokens < cap else self.asked, asked_max_tokens=self.asked)

    def open(self, r: InFlight, cap: int, typical: float | None) -> InFlight:
        """``r`` (open on the worker, its length not known yet) as if sent with ``max_tokens`` at ``cap``,
        where the cohort's ``typical`` answer (:meth:`typical`) fits under it; else as asked."""
        if r.interactive is not self.interactive or r.asked != self.asked:
            return r
        return replace(r, max_tokens=cap if typical is not None and typical < cap else self.asked,
                       asked_max_tokens=self.asked)  # fmt: skip

    def of(self, o: Observed | InFlight) -> bool:
        return o.interactive is self.interactive and o.asked == self.asked

    def typical(self, workload: tuple[Observed, ...]) -> float | None:
        """The median answer of the cohort's in ``workload`` (None: none)."""
        written = [o.output_tokens for o in workload if self.of(o)]
        return statistics.median(written) if written else None

    def sent_all(
        self, workload: tuple[Observed, ...], in_flight: tuple[InFlight, ...], cap: int
    ) -> tuple[tuple[Observed, ...], tuple[InFlight, ...]]:
        """The answered and the open requests as sent with the cohort's ``max_tokens`` at ``cap``."""
        typical = self.typical(workload)
        return tuple(self.sent(o, cap) for o in workload), tuple(self.open(r, cap, typical) for r in in_flight)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetInputs:
    """What the prediction of one budget reads (gathered on the event loop, replayed off it)."""

    gpu: str
    model: str
    args: Mapping[str, object]
    decode: tuple[DecodeStats, ...]
    kv_capacity_tokens: int | None
    workload: tuple[Observed, ...]  # the worker's newest answered requests (the planner's workload)
    in_flight: tuple[InFlight, ...] = ()
    now: float | None = None
    max_requests: int = 300  # the newest this many are replayed
    horizon_s: float = 600.0  # the traffic that follows them (:func:`~proxy.control.workload.continued`)
    cohort: Cohort
    before: int  # the max_tokens its requests went with before (the previous budget, or as asked)
    budget: int  # the max_tokens they go with now (as asked where the budget does not apply)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPrediction:
    """The twin's throughput without and with the budget; ``not_predicted`` says why there is none."""

    ratio: float | None  # with / without (None: not predicted)
    before_tok_per_s: float | None = None
    budget_tok_per_s: float | None = None
    # |twin - worker| / worker throughput on the replayed window as it went (None: not known)
    twin_error: float | None = None
    requests: int = 0  # replayed
    cohort: int = 0  # of them, the cohort's
    # with the budget and at most ``held_at`` requests running, the batch the worker's CUDA graphs cover
    # (None: not replayed: the budget does not apply, or the worker never runs past its graphs)
    held_tok_per_s: float | None = None
    held_at: int | None = None
    # the replayed sample's mean time from arrival to answer, with the budget and held (None: not known)
    budget_answer_s: float | None = None
    held_answer_s: float | None = None

    def hold(self, min_gain: float) -> int | None:
        """The most requests to hold open on the worker while the budget applies: its graphs' batch
        where the held replay writes more than the budget's alone by ``min_gain``, or the same tokens
        (no fewer less ``min_gain``, as the planner's waiting basis counts them) answered sooner by
        ``min_gain``: a worker that keeps up with what arrives writes what arrives either way; None:
        no hold."""
        if self.held_at is None or self.held_tok_per_s is None or not self.budget_tok_per_s:
            return None
        if self.held_tok_per_s >= self.budget_tok_per_s * (1.0 + min_gain):
            return self.held_at
        sooner = (self.held_answer_s is not None and self.budget_answer_s is not None
                  and self.held_answer_s <= self.budget_answer_s * (1.0 - min_gain))  # fmt: skip
        return self.held_at if sooner and self.held_tok_per_s >= self.budget_tok_per_s * (1.0 - min_gain) else None


def _newest(workload: tuple[Observed, ...], n: int) -> list[Observed]:
    return sorted(workload, key=lambda o: o.arrived)[-n:]


def _replayed(twin: Twin, inputs: BudgetInputs, cap: int, args: Mapping[str, object] | None = None) -> Prediction:
    """The twin under ``args`` (the worker's) with the cohort sent at ``cap``, all the work drained."""
    workload, in_flight = inputs.cohort.sent_all(inputs.workload, inputs.in_flight, cap)
    loaded = replay(_newest(workload, inputs.max_requests), workload, in_flight, inputs.now)
    return twin.predict(inputs.args if args is None else args, continued(loaded, inputs.horizon_s))


def _throughput(p: Prediction) -> float:
    return 0.0 if p.oom else p.output_tok_per_s


def _held_args(twin: Twin, args: Mapping[str, object]) -> tuple[int, dict[str, object]] | None:
    """The batch the worker's CUDA graphs cover, and its arguments running at most that many (the
    proxy holding the rest); None where it never runs past its graphs, or runs without them."""
    cfg = twin.config(args)
    graphs, names = graph_max_bs(cfg), twin.names
    if graphs <= 0 or running_cap(cfg) <= graphs:
        return None
    held = {**args, names.max_running: graphs}
    if names.graph_max_bs is not None:  # as it resolved: a running cap may lower the engine's default
        held[names.graph_max_bs] = graphs
    return graphs, held


def predict_budget(inputs: BudgetInputs) -> BudgetPrediction | str:
    """The budget's predicted throughput ratio (see the module's words), or why there is none."""
    sample = _newest(inputs.workload, inputs.max_requests)
    cohort = sum(1 for o in sample if inputs.cohort.of(o))
    if not sample:
        return "no answered request to replay"
    if cohort == 0:
        kind = "interactive" if inputs.cohort.interactive else "batch"
        return f"none of the {len(sample)} newest answers is the {kind} class's asking for max_tokens {inputs.cohort.asked}"
    window = replay(sample, inputs.workload, inputs.in_flight, inputs.now)
    twin = calibrate(inputs.gpu, inputs.model, inputs.args, inputs.decode, inputs.kv_capacity_tokens, window)
    try:
        twin.config(inputs.args)
    except SimConfigError as exc:
        return f"the twin would not start: {exc}"
    seen, measured = twin.predict(inputs.args, window).answered_tok_per_s, window.measured()
    error = abs(seen - measured) / measured if seen is not None and measured else None
    was = _replayed(twin, inputs, inputs.before)
    now = was if inputs.budget == inputs.before else _replayed(twin, inputs, inputs.budget)
    before, budget = _throughput(was), _throughput(now)
    if before <= 0:
        return "the twin served nothing as the requests were sent before"
    p = BudgetPrediction(ratio=budget / before, before_tok_per_s=before, budget_tok_per_s=budget,
                         twin_error=error, requests=len(sample), cohort=cohort)  # fmt: skip
    held_at = _held_args(twin, inputs.args) if now is not was and budget > 0 else None
    if held_at is None:
        return p
    held = _replayed(twin, inputs, inputs.budget, held_at[1])
    return replace(p, held_tok_per_s=_throughput(held), held_at=held_at[0], budget_answer_s=now.mean_answer_s,
                   held_answer_s=None if held.oom else held.mean_answer_s)  # fmt: skip
