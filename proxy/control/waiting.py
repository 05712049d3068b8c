"""The waiting basis: a restart that writes the same tokens but answers them sooner.

Where the worker keeps up with what arrives, other arguments do not write more tokens per second,
but requests may wait less. :func:`waiting_savings` prices each candidate in request-seconds of
waiting saved over the horizon; :func:`waiting_basis` takes the one whose mean saving over the recent
looks is the most, sets it against the waiting a restart's outage adds
(:func:`~proxy.control.economics.outage_waiting_s`) in a :class:`WaitingPlan`, and drops it where the
twin misses the worker's answer times by more than it answers sooner.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.control.candidates import Replayed, args_key, roomier_pool
from proxy.control.economics import ERROR_LOOKS, PlanSettings, RestartCost, no_worse, outage_waiting_s
from proxy.control.twin import Prediction, Twin
from proxy.control.workload import Observed, Replay

__all__ = ["WaitingPlan", "waiting_basis", "waiting_savings"]


def waiting_basis(
    twin: Twin,
    r: Replayed,
    in_flight: int,
    cost: RestartCost,
    settings: PlanSettings,
    earlier_savings: Sequence[Mapping[str, float]],
) -> tuple[WaitingPlan | None, dict[str, float], int]:
    """The waiting basis: its candidate (None: none answers sooner by more than the twin misses this
    worker's answers by), each candidate's waiting saved, and the replays it took."""
    capacities: dict[str, float | None] = {}  # each args' output tokens/s with the sample all waiting

    def capacity(p: Prediction) -> float | None:
        key = args_key(p.args)
        if key not in capacities:
            capacities[key] = _capacity(twin, p, r.loaded)
        return capacities[key]

    current, sample = r.current, r.sample
    savings = waiting_savings(current, r.served, sample, settings, capacity)
    waiting = _waiting_plan(current, r.served, sample, in_flight, cost, settings, savings, earlier_savings, capacity)
    replays = len(capacities)
    if waiting is not None and current.mean_answer_s and waiting.quicker.mean_answer_s is not None:
        sooner = 1.0 - waiting.quicker.mean_answer_s / current.mean_answer_s
        answered = [o.finished - o.arrived for o in sample if o.finished is not None]
        measured_answer = sum(answered) / len(answered) if answered and len(answered) == len(sample) else None
        # the waiting basis is judged on answer time: how far the twin's is from the worker's on the sample
        seen = r.seen.mean_answer_s
        answer_error = abs(seen - measured_answer) / measured_answer if measured_answer and seen is not None else None
        if answer_error is not None and sooner <= answer_error:
            waiting = None  # answers sooner by less than the twin misses this worker's answers by
    if waiting is not None and waiting.saved_s > waiting.cost_s:
        roomier = roomier_pool(twin, waiting.quicker, r.loaded, settings)
        replays += roomier is not None
        answers = roomier.mean_answer_s if roomier is not None else None
        quickest = waiting.quicker.mean_answer_s
        if roomier is not None and answers is not None and quickest and no_worse(quickest, answers, settings):
            waiting = replace(waiting, quicker=roomier)
    return waiting, savings, replays


def _capacity(twin: Twin, chosen: Prediction, loaded: Replay) -> float | None:
    """Output tokens/s the twin writes under ``chosen``'s args with the sample's own requests all
    waiting at once: what the worker can do on this work, the denominator of its utilization."""
    waiting = tuple(replace(sp, arrival=0.0) for sp in loaded.specs if sp.rid in loaded.foreground)
    if not waiting:
        return None
    most = twin.predict(chosen.args, Replay(waiting, loaded.foreground))
    return most.output_tok_per_s if most.oom is None and most.output_tok_per_s > 0 else None


@dataclass(frozen=True, slots=True)
class WaitingPlan:
    """A restart for the waiting (:func:`_waiting_plan`): the candidate, the request-seconds of waiting
    it saves over the horizon (a mean over ``looks`` looks) and those the restart adds, at
    ``utilization`` (None: not known)."""

    quicker: Prediction
    saved_s: float
    cost_s: float
    utilization: float | None
    looks: int = 1
    this_look_s: float = 0.0  # what it saves on this look alone

    @property
    def over_looks(self) -> str:
        """What the reason says of the looks the saving is a mean over (nothing for one)."""
        return f" (a mean over {self.looks} looks; {self.this_look_s:.0f} on this one)" if self.looks > 1 else ""


def _arrivals(sample: Sequence[Observed]) -> tuple[float, float] | None:
    """The sample's arrival rate (requests/s) and the output tokens/s of its arrivals, over the span
    from its first arrival to its last; None: fewer than two, or all at one moment."""
    arrived = sorted(o.arrived for o in sample)
    span = arrived[-1] - arrived[0] if len(arrived) >= 2 else 0.0
    if span <= 0:
        return None
    return (len(arrived) - 1) / span, sum(o.output_tokens for o in sample) / span


def waiting_savings(
    current: Prediction,
    served: Sequence[Prediction],
    sample: Sequence[Observed],
    settings: PlanSettings,
    capacity: Callable[[Prediction], float | None] = lambda _: None,
) -> dict[str, float]:
    """The request-seconds of waiting each candidate that writes the same tokens (no fewer than the
    current args less ``min_gain``) saves over the horizon on this sample: its mean answer saved x the
    sample's arrival rate x the horizon (negative: it answers later). Empty where the waiting basis is
    not asked: no answer times to compare, or the sample arrived faster than the quickest of them
    writes it (``capacity``: output tokens/s with the sample all waiting; a batch submitted at once,
    whose "rate" x the horizon counts requests that never come)."""
    found = _arrivals(sample)
    if found is None or not current.mean_answer_s:
        return {}
    rate, output_rate = found
    floor = current.output_tok_per_s * (1.0 - settings.min_gain)
    same = [p for p in served if p.mean_answer_s is not None and p.output_tok_per_s >= floor]
    if not same:
        return {}
    most = capacity(min(same, key=lambda p: p.mean_answer_s or 0.0))
    if most and output_rate >= most:
        return {}
    return {
        args_key(p.args): (current.mean_answer_s - (p.mean_answer_s or 0.0)) * rate * settings.horizon_s for p in same
    }


def _waiting_plan(
    current: Prediction,
    served: Sequence[Prediction],
    sample: Sequence[Observed],
    in_flight: int,
    cost: RestartCost,
    settings: PlanSettings,
    savings: Mapping[str, float],
    earlier: Sequence[Mapping[str, float]] = (),
    capacity: Callable[[Prediction], float | None] = lambda _: None,
) -> WaitingPlan | None:
    """Where no candidate writes more tokens per second (arrivals the worker keeps up with), the
    candidate answering the same requests sooner by a real margin (``min_gain``) on this look whose
    waiting saved over the horizon (``savings``, :func:`waiting_savings`) is the most on average over
    this look and the ``earlier`` looks that asked the waiting basis (newest last, the last
    ``ERROR_LOOKS - 1``), with that mean, the request-seconds the restart adds
    (:func:`outage_waiting_s`: the outage is the drain, the start-up and the work computed again; the
    ``in_flight`` requests open on the worker and those ``settings.queued`` for it in the proxy wait it out), the
    utilization they were priced at (the sample's output per second of its arrivals over ``capacity``
    of the candidate; None: not known) and the looks the mean is over.

    The mean, not this look alone: under bursty arrivals the waiting a candidate saves comes in the
    bursts. In early-stop's bursty hour the looks that caught a burst read 260-311 request-seconds
    saved over the horizon against 208-246 the restart adds, the looks between them about none, and a
    restart taken on two such looks in a row lost 1.7 % of the hour's waiting: it paid 228
    request-seconds and saved 15 in the 1,200 modelled seconds after it.

    None: nothing to compare, no candidate sooner by the margin, no saving on average, or the sample
    arrived faster than the candidate serves it (utilization 1 or more: a backlog, which the throughput
    basis is for)."""
    found = _arrivals(sample)
    if found is None or current.mean_answer_s is None or not savings:
        return None
    rate, output_rate = found
    looks = [*earlier[-(ERROR_LOOKS - 1) :], savings]

    def over_looks(key: str) -> tuple[float, int]:
        seen = [look[key] for look in looks if key in look]
        return statistics.fmean(seen), len(seen)

    quicker, saved, count = current, 0.0, 0
    for p in served:  # sooner on this look by a real margin, the most saved over the looks
        key = args_key(p.args)
        if key not in savings or p.mean_answer_s is None:
            continue
        if p.mean_answer_s > current.mean_answer_s * (1.0 - settings.min_gain):
            continue
        mean, n = over_looks(key)
        if mean > saved:
            quicker, saved, count = p, mean, n
    if quicker is current:
        return None
    most = capacity(quicker)
    utilization = output_rate / most if most else None
    if utilization is not None and utilization >= 1.0:
        # the sample arrived faster than the candidate writes it (a batch submitted at once): the worker
        # does not keep up, the waiting is the throughput's, and its "rate" x the horizon counts requests
        # that will never come (shift's batch: 300 requests in a fraction of a second, utilization 517,
        # 1.4 million request-seconds "saved" over 60 s, and a restart that paid on nothing)
        return None
    outage = cost.outage_s(current.output_tok_per_s)
    paid = outage_waiting_s(in_flight + settings.queued, rate, outage, utilization)
    return WaitingPlan(quicker, saved, paid, utilization, count, savings[args_key(quicker.args)])
