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
Pure and CPU-bound: it runs off the event loop, where plans run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from proxy.control.twin import DecodeStats, Twin, calibrate
from proxy.control.workload import InFlight, Observed, continued, replay
from proxy.sim.config import SimConfigError

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


def _newest(workload: tuple[Observed, ...], n: int) -> list[Observed]:
    return sorted(workload, key=lambda o: o.arrived)[-n:]


def _throughput(twin: Twin, inputs: BudgetInputs, cap: int) -> float:
    """The twin's output tokens/s, all the work drained, with the cohort sent at ``cap``."""
    workload, in_flight = inputs.cohort.sent_all(inputs.workload, inputs.in_flight, cap)
    loaded = replay(_newest(workload, inputs.max_requests), workload, in_flight, inputs.now)
    p = twin.predict(inputs.args, continued(loaded, inputs.horizon_s))
    return 0.0 if p.oom else p.output_tok_per_s


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
    before = _throughput(twin, inputs, inputs.before)
    budget = before if inputs.budget == inputs.before else _throughput(twin, inputs, inputs.budget)
    if before <= 0:
        return "the twin served nothing as the requests were sent before"
    return BudgetPrediction(ratio=budget / before, before_tok_per_s=before, budget_tok_per_s=budget,
                            twin_error=error, requests=len(sample), cohort=cohort)  # fmt: skip
