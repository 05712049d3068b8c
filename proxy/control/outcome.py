"""The check of an acted plan: its twin against the worker on the requests served under the new arguments.

After a restart, the plan's twin (calibrated under the old arguments) replays what the worker did
since (:func:`check_outcome`), under the new arguments and under the old: the predicted figure against
the measured one on the plan's basis (throughput, or answer time), and what the new arguments gained
on the traffic that came. The journal records them side by side.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.control.twin import Twin
from proxy.control.workload import InFlight, Observed, replay

__all__ = ["Expectation", "Outcome", "OutcomeInputs", "check_outcome"]


@dataclass(frozen=True, slots=True)
class Expectation:
    """What an acted plan expects of the worker: its twin (calibrated under the old args) on the new
    args, judged on the plan's basis ("throughput": the sample's own tokens per second; "waiting":
    its mean answer time)."""

    twin: Twin
    args: Mapping[str, object]
    basis: str = "throughput"
    old_args: Mapping[str, object] | None = None  # the args the twin was calibrated under (None: no gain measured)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeInputs:
    """What the check of an acted plan reads, once the worker has served under its new args."""

    expectation: Expectation
    workload: tuple[Observed, ...]  # the worker's newest answered requests
    since: float  # the outcome window opened here (same clock): only requests arrived since are judged
    in_flight: tuple[InFlight, ...] = ()  # open on the worker at ``now``
    now: float
    max_requests: int = 300
    ready: float | None = None  # the restart's worker was ready here: what it held ran on it from then at most


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """The plan's twin against the worker on the same requests, served under the new args."""

    basis: str
    predicted: float | None  # tokens/s or seconds, on the basis
    measured: float | None
    requests: int  # the requests judged
    # what the worker did in the window (tok/s, :meth:`~proxy.control.workload.Replay.measured`), any basis
    throughput: float | None = None
    # the same figure of the twin under the old args, on the same requests: what the worker would have
    # done had it not restarted (the twin was calibrated there, and checked against it before acting)
    without: float | None = None
    # the mean answer time of the requests judged, the twin's and the worker's, any basis: a worker that
    # keeps up answers what arrives at any speed, twin and worker alike, and only its answer times
    # say how fast it was
    answer_predicted: float | None = None
    answer_measured: float | None = None

    @property
    def answer_error(self) -> float | None:
        """|predicted - measured| / measured mean answer time (None: not known)."""
        if self.answer_predicted is None or not self.answer_measured:
            return None
        return abs(self.answer_predicted - self.answer_measured) / self.answer_measured

    @property
    def gain(self) -> float | None:
        """What the new args gained on the traffic that came: the worker's throughput in the window
        over the twin's under the old args on the same requests, minus 1 (None: either is not known).
        Throughput before the restart against throughput after says as much about the traffic (its
        rate, its lengths, a burst's end) as about the args."""
        return self.throughput / self.without - 1.0 if self.throughput is not None and self.without else None

    @property
    def error(self) -> float | None:
        """|predicted - measured| / measured (None: nothing to judge)."""
        if self.predicted is None or not self.measured:
            return None
        return abs(self.predicted - self.measured) / self.measured


def check_outcome(inputs: OutcomeInputs) -> Outcome:
    """Replay what the worker did since the outcome window opened (the requests that arrived since,
    with the work then on it and the work open now) on the plan's twin under the new args, and set
    what it predicts against what the worker did: the twin's prediction for arguments it was not
    calibrated on, on traffic it had not seen, like with like. The traffic after a restart is never
    the one the plan replayed, so the plan's own figure against a window's throughput says as much
    about the traffic as about the twin. On the plan's basis: "throughput", the output of the
    requests answered in the window per second (:meth:`~proxy.control.workload.Replay.measured`, what
    the engine's counter of generated tokens reads: a twin too fast or too slow answers more or fewer
    of them by now);
    "waiting", the mean answer time of the requests that arrived since and were answered."""
    expect = inputs.expectation
    answered = [o for o in inputs.workload if o.arrived >= inputs.since and o.finished is not None]
    sample = sorted(answered, key=lambda o: o.arrived)[-inputs.max_requests :]
    loaded = replay(sample, inputs.workload, inputs.in_flight, inputs.now, start=inputs.since, began=inputs.ready)
    if loaded.until is None or (expect.basis == "waiting" and len(sample) < 2):
        return Outcome(basis=expect.basis, predicted=None, measured=None, requests=len(sample))
    p = expect.twin.predict(expect.args, loaded)
    throughput = loaded.measured()
    old = expect.twin.predict(expect.old_args, loaded) if expect.old_args is not None else None
    answer_s = statistics.fmean((o.finished or o.arrived) - o.arrived for o in sample) if len(sample) >= 2 else None
    if expect.basis == "waiting":
        measured, predicted = answer_s, p.mean_answer_s
    else:
        measured, predicted = throughput, p.answered_tok_per_s
    return Outcome(basis=expect.basis, predicted=predicted, measured=measured, requests=len(loaded.answered),
                   throughput=throughput, without=old.answered_tok_per_s if old is not None else None,
                   answer_predicted=p.mean_answer_s, answer_measured=answer_s)  # fmt: skip
