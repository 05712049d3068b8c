"""How an act turned out: the outcome window after a restart, and the check of an acted plan's twin.

A restart leaves a :class:`PendingOutcome`: once the worker has served ``window_s`` again its window
is journaled beside the one before (:func:`journal_outcome`). An acted plan's expectation then
waits as a :class:`PendingCheck` until the worker has answered enough requests under the new
arguments (:func:`check_due`); an :class:`OutcomeJob` replays them off the loop and
:func:`outcome_fields` journals how the twin did. Pure over their inputs but for the journal writes,
so the controller only decides when each step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.control.constants import Constants
from proxy.control.journal import Journal, verdict
from proxy.control.planner import Expectation, InFlight, Observed, Outcome, OutcomeInputs
from proxy.control.window import Window
from proxy.workers.base import WorkerId

__all__ = [
    "CHECK_AFTER_WINDOWS",
    "OutcomeJob",
    "PendingCheck",
    "PendingOutcome",
    "check_due",
    "check_job",
    "journal_outcome",
    "outcome_fields",
]


@dataclass(frozen=True, slots=True)
class PendingOutcome:
    """A restart whose outcome window is not in yet."""

    entry_id: int
    opens: float  # the worker serves again and has computed again what it took back
    due: float  # the window is in
    expectation: Expectation | None = None  # an acted plan's: checked on the requests served since ``opens``
    ready: float | None = None  # the restarted worker was ready here

    def is_in(self, window: Window, min_evidence_s: float, now: float) -> bool:
        """Its window is in: due, and the worker's window holds enough evidence."""
        return now >= self.due and window.observed_s >= min_evidence_s


# an acted plan's twin is checked once the worker has answered as many requests under the new args as a
# plan replays (``plan_requests``), when its serving under them ends (a restart) or, at the latest, this
# many outcome windows after they opened: a window of long answers holds a few dozen, whose throughput
# says more about which of them happened to end in it than about the twin
CHECK_AFTER_WINDOWS = 10


@dataclass(frozen=True, slots=True)
class PendingCheck:
    """An acted plan whose twin is checked on the requests the worker answers under its args."""

    entry_id: int
    expectation: Expectation
    since: float  # the outcome window opened here: requests arrived since are judged
    until: float  # checked on what was answered by then, however many
    ready: float | None = None  # the restarted worker was ready here


@dataclass(frozen=True, slots=True)
class OutcomeJob:
    """The check of an acted plan against what the worker did (:func:`~proxy.control.planner.check_outcome`)."""

    worker_id: WorkerId
    entry_id: int
    inputs: OutcomeInputs


def journal_outcome(
    pending: PendingOutcome, window: Window, journal: Journal, constants: Constants
) -> PendingCheck | None:
    """Journal the restart's outcome window (``window``, in: :meth:`PendingOutcome.is_in`) beside the one
    before it; returns the check of its plan's twin where a plan made the restart."""
    entry = journal.get(pending.entry_id)
    after = window.summary()
    before = (entry or {}).get("outcome", {}) or {}
    fields: dict[str, float] | None = None
    tb, ta = (before.get("before") or {}).get("throughput"), after.get("throughput")
    if pending.expectation is not None and isinstance(ta, (int, float)) and ta > 0:
        # the first window after the restart: the gain stands until the check's, over a few hundred
        # answers each side, replaces it (:func:`outcome_fields`; a restart's first minute refills
        # what it took back, on a start-up's admission)
        fields = {"first_window_throughput": ta}
        if isinstance(tb, (int, float)) and tb > 0:
            fields["first_window_gain"] = round(ta / tb - 1.0, 4)
        if "gain_requests" not in (entry or {}):  # the check's figures, if they came first, stay
            fields["measured_throughput"] = ta
            if "first_window_gain" in fields:
                fields["measured_gain"] = fields["first_window_gain"]
    journal.update(
        pending.entry_id,
        outcome={"after": after, "verdict": verdict(before.get("before") or {}, after)},
        fields=fields,
    )
    if pending.expectation is None:
        return None
    until = pending.opens + CHECK_AFTER_WINDOWS * constants.window_s
    return PendingCheck(pending.entry_id, pending.expectation, pending.opens, until, pending.ready)


def check_due(
    pending: PendingCheck, workload: Sequence[Observed], serving: bool, now: float, plan_requests: int
) -> bool:
    """The check is due once the worker has answered ``plan_requests`` requests under its args, once it
    stops serving under them (it restarts or died: on what it answered until then), or at its latest."""
    if not serving or now >= pending.until:
        return True
    answered = sum(1 for o in workload if o.arrived >= pending.since and o.finished is not None)
    return answered >= plan_requests


def check_job(
    worker_id: WorkerId,
    pending: PendingCheck,
    workload: tuple[Observed, ...],
    in_flight: tuple[InFlight, ...],
    now: float,
    plan_requests: int,
) -> OutcomeJob:
    """The check's replay: the requests it is checked on, taken once."""
    inputs = OutcomeInputs(expectation=pending.expectation, workload=workload, since=pending.since,
                           in_flight=in_flight, now=now, max_requests=plan_requests, ready=pending.ready)  # fmt: skip
    return OutcomeJob(worker_id, pending.entry_id, inputs)


def outcome_fields(outcome: Outcome) -> dict[str, object]:
    """The journal's figures of how the plan's twin did on the requests served under its args:
    ``prediction_error`` on the plan's basis (none when too few requests were answered in the window)."""
    fields: dict[str, object] = {"prediction_basis": outcome.basis, "outcome_requests": outcome.requests}
    if outcome.error is not None and outcome.predicted is not None and outcome.measured is not None:
        fields |= {"predicted_outcome": round(outcome.predicted, 3), "measured_outcome": round(outcome.measured, 3),
                   "prediction_error": round(outcome.error, 4)}  # fmt: skip
    if outcome.basis != "waiting" and outcome.answer_error is not None:  # what the throughput cannot see
        fields |= {"answer_error": round(outcome.answer_error, 4)}
    if outcome.gain is not None and outcome.throughput is not None:  # over the same answers, like with like
        fields |= {"measured_gain": round(outcome.gain, 4), "measured_throughput": round(outcome.throughput, 1),
                   "gain_requests": outcome.requests}  # fmt: skip
    return fields
