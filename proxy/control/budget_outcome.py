"""How an output budget turned out: the worker's pace after it against its pace before.

A budget set or moved leaves a :class:`PendingBudget` with the window before it (while the worker
had work: :meth:`~proxy.control.window.Window.busy`), its saturated pace then (a
:class:`~proxy.control.saturation.Pace`: what it wrote while admission limited it, its batch
settled, read back as far as the facts' window to gather enough of it) and the class's time to
first token. Once the outcome window a restart would wait for is in (``window_s`` after the
decision), the window after is journaled beside it (:func:`window_outcome`): the measured gain (the
saturated pace after over before, like with like: a load's ramp-up or idle spells are not the
budget's doing), or ``not_measured`` where either side had too little saturated time; and the
class's time to first token before and after (where the proxy saw first tokens: streams).
:func:`judged` says whether the measured gain met the predicted one within the twin's error.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.control.budget_gain import Cohort
from proxy.control.journal import verdict
from proxy.control.saturation import Pace
from proxy.control.window import Window
from proxy.control.workload import Observed

__all__ = ["PendingBudget", "first_token_s", "judged", "pace_fields", "window_outcome"]


@dataclass(frozen=True, slots=True)
class PendingBudget:
    """A budget set or moved whose outcome window is not in yet."""

    entry_id: int
    cohort: Cohort
    opens: float  # the decision: requests sent from here on went with it
    due: float  # the window after it is in
    before: Mapping[str, Any]  # the worker's window before it (:meth:`Window.summary`, while it had work)
    first_token_before_s: float | None  # the class's mean time to first token before it (None: not seen)
    pace: Pace  # the worker's saturated pace before it (:func:`~proxy.control.saturation.saturated_pace`)

    def is_in(self, window: Window, min_evidence_s: float, now: float) -> bool:
        """Its window is in: due, and the worker's window holds enough evidence."""
        return now >= self.due and window.observed_s >= min_evidence_s


def first_token_s(workload: Sequence[Observed], interactive: bool, since: float, until: float) -> float | None:
    """The class's mean time from arrival to first token, over its requests that arrived in
    [``since``, ``until``) and were answered by ``until`` (None: the proxy saw no first token: whole
    answers)."""
    waits = [
        o.first_token - o.arrived
        for o in workload
        if o.interactive is interactive and o.first_token is not None and since <= o.arrived < until
        and o.finished is not None and o.finished <= until
    ]  # fmt: skip
    return statistics.fmean(waits) if waits else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def pace_fields(pace: Pace) -> dict[str, float | None]:
    """A side's saturated pace as its outcome window quotes it."""
    rate = pace.tok_per_s
    return {"saturated_s": round(pace.seconds, 1), "saturated_throughput": None if rate is None else round(rate, 2)}


def _unmeasured(before: Pace, after: Pace, settle_s: float, enough_s: float) -> str | None:
    """Why the paces do not compare (None: they do)."""
    for side, pace in (("before", before), ("after", after)):
        if pace.seconds < enough_s or pace.seconds <= 0:
            return (f"the worker was saturated, its batch settled (a run's first {settle_s:g} s not counted), "
                    f"for {pace.seconds:.1f} s {side} it, of the {enough_s:g} s a measure needs")  # fmt: skip
    return "the worker wrote nothing while saturated before it" if not before.tokens else None


def window_outcome(
    pending: PendingBudget,
    after: Mapping[str, Any],
    paced: Pace,
    first_token_after_s: float | None,
    *,
    settle_s: float,
    enough_s: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The journal's outcome (``before``, ``after``, ``verdict``) and top-level figures of one budget's
    window: the worker's saturated pace after over before (``measured_gain``; ``not_measured`` where
    either side had less than ``enough_s`` of it, past each run's first ``settle_s``), the class's
    first-token times."""
    fields: dict[str, Any] = {
        "first_token_before_s": _round(pending.first_token_before_s, 3),
        "first_token_after_s": _round(first_token_after_s, 3),
    }
    before, rate = pending.pace.tok_per_s, paced.tok_per_s
    if (why := _unmeasured(pending.pace, paced, settle_s, enough_s)) is None and before and rate is not None:
        fields |= {"measured_throughput": round(rate, 1), "measured_gain": round(rate / before - 1.0, 4)}
    else:
        fields["not_measured"] = why
    after = {**after, **pace_fields(paced)}
    outcome = {"before": dict(pending.before), "after": after, "verdict": verdict(pending.before, after)}
    return outcome, fields


def judged(entry: Mapping[str, Any], min_gain: float) -> dict[str, Any]:
    """Whether the measured gain met the predicted one within the twin's error (at least ``min_gain``,
    the least gain the planner tells from noise), once the entry holds both; else nothing."""
    predicted, measured = entry.get("predicted_gain"), entry.get("measured_gain")
    if not isinstance(predicted, (int, float)) or not isinstance(measured, (int, float)):
        return {}
    error = entry.get("twin_error")
    tolerance = max(error if isinstance(error, (int, float)) else 0.0, min_gain)
    met = abs((1.0 + measured) - (1.0 + predicted)) <= tolerance * (1.0 + predicted)
    return {"prediction_tolerance": round(tolerance, 4), "met_prediction": met}
