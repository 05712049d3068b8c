"""The gain an output budget is predicted to bring: the planner's twin on the worker's recent requests.

When the fast tier sets or moves a class's output budget, the worker's twin is calibrated as for a
plan (:func:`~proxy.control.twin.calibrate`, on the worker's decode lines and the replay of its newest
answers) and replays those answers, with the traffic that follows them
(:func:`~proxy.control.workload.continued`), twice under the worker's current arguments: with the
class's requests asking for that ``max_tokens`` sent as they were sent before the decision, and sent
with the budget. An answer that reaches the budget is continued by the proxy; the twin models it as
the same whole answer sent as before (it cannot send the rest again). Requests open on the worker
keep what they were sent with. The predicted gain is the ratio of the two throughputs; the twin's
error on the window as it went says how far that can be trusted (:func:`predict_budget`). Pure and
CPU-bound: it runs off the event loop, where plans run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from proxy.control.twin import DecodeStats, Twin, calibrate
from proxy.control.workload import InFlight, Observed, continued, replay
from proxy.sim.config import SimConfigError

__all__ = ["BudgetInputs", "BudgetPrediction", "predict_budget", "sent_as"]


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
    interactive: bool  # the class the budget is of
    asked: int  # the max_tokens its requests ask for
    before: int  # the max_tokens they went with before (the previous budget, or as asked)
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
    cohort: int = 0  # of them, the class's asking for ``asked``
    not_predicted: str | None = None


def sent_as(o: Observed, inputs: BudgetInputs, cap: int) -> Observed:
    """``o`` as the worker would have been asked for it with the class's ``max_tokens`` at ``cap``: one
    of the cohort whose answer fits under ``cap`` goes with it; one that reaches it goes on in another
    part, modelled as the same whole answer, sent as asked."""
    if o.interactive is not inputs.interactive or o.asked != inputs.asked:
        return o
    return replace(o, max_tokens=cap if o.output_tokens < cap else inputs.asked, asked_max_tokens=inputs.asked)


def _newest(workload: tuple[Observed, ...], n: int) -> list[Observed]:
    return sorted(workload, key=lambda o: o.arrived)[-n:]


def _throughput(twin: Twin, inputs: BudgetInputs, cap: int) -> float:
    """The twin's output tokens/s, all the work drained, with the cohort sent at ``cap``."""
    workload = tuple(sent_as(o, inputs, cap) for o in inputs.workload)
    loaded = replay(_newest(workload, inputs.max_requests), workload, inputs.in_flight, inputs.now)
    p = twin.predict(inputs.args, continued(loaded, inputs.horizon_s))
    return 0.0 if p.oom else p.output_tok_per_s


def predict_budget(inputs: BudgetInputs) -> BudgetPrediction:
    """The budget's predicted throughput ratio (see the module's words), or why there is none."""
    sample = _newest(inputs.workload, inputs.max_requests)
    cohort = sum(1 for o in sample if o.interactive is inputs.interactive and o.asked == inputs.asked)
    if not sample:
        return BudgetPrediction(ratio=None, not_predicted="no answered request to replay")
    if cohort == 0:
        kind = "interactive" if inputs.interactive else "batch"
        return BudgetPrediction(ratio=None, requests=len(sample), not_predicted=(
            f"none of the {len(sample)} newest answers is the {kind} class's asking for max_tokens {inputs.asked}"))  # fmt: skip
    if inputs.before == inputs.budget:  # it changes nothing the worker is sent
        return BudgetPrediction(ratio=1.0, requests=len(sample), cohort=cohort)
    window = replay(sample, inputs.workload, inputs.in_flight, inputs.now)
    twin = calibrate(inputs.gpu, inputs.model, inputs.args, inputs.decode, inputs.kv_capacity_tokens, window)
    try:
        twin.config(inputs.args)
    except SimConfigError as exc:
        return BudgetPrediction(ratio=None, requests=len(sample), cohort=cohort,
                                not_predicted=f"the twin would not start: {exc}")  # fmt: skip
    seen, measured = twin.predict(inputs.args, window).answered_tok_per_s, window.measured()
    error = abs(seen - measured) / measured if seen is not None and measured else None
    before, budget = _throughput(twin, inputs, inputs.before), _throughput(twin, inputs, inputs.budget)
    if before <= 0:
        return BudgetPrediction(ratio=None, requests=len(sample), cohort=cohort, twin_error=error,
                                not_predicted="the twin served nothing as the requests were sent before")  # fmt: skip
    return BudgetPrediction(ratio=budget / before, before_tok_per_s=before, budget_tok_per_s=budget,
                            twin_error=error, requests=len(sample), cohort=cohort)  # fmt: skip
