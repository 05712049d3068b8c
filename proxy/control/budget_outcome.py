"""How an output budget turned out: the worker's pace with it against its pace with it held back.

A budget changes how the engine admits the class's requests, so its gain shows only while admission
limits the worker: its saturated, settled pace (:mod:`proxy.control.saturation`). The pace before the
decision seldom compares: a budget is set once the class's first answers are in, while the engine
still fills its batch, or as the class's traffic joins other traffic. So a budget set or moved is
measured by a check on the same worker and traffic, one side after the other (:class:`PendingBudget`,
:func:`advance`): the class goes with the budget until none of its requests sent before is open on
the worker (its batch turned over) and ``enough_s`` of saturated time is read; then the budget is
held back (the requests go as they went before it) until the batch turned over again and as much
is read; then it applies again. The measured gain is the pace with it over the pace held back
(:func:`check_outcome`); ``not_measured`` says why where a side's batch did not turn over within
the outcome window (``window_s``) beyond the longest stay of the class's requests on the worker,
or it was not saturated long enough within the outcome window after. :func:`judged` says whether
the measured gain met the predicted one within the twin's error.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.control.budget_gain import Cohort
from proxy.control.journal import verdict
from proxy.control.saturation import Pace, saturated_pace
from proxy.control.window import Window
from proxy.control.workload import Observed

__all__ = [
    "PendingBudget",
    "Side",
    "advance",
    "check_outcome",
    "first_token_s",
    "judged",
    "longest_stay_s",
    "pace_fields",
]


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a budget's check: the class sent one way from ``switched`` on."""

    switched: float
    turned_over: float | None = None  # when none of the class's requests sent before was open any more
    pace: Pace = field(default_factory=Pace)  # the worker's settled saturated pace since then, as last read

    def read(
        self, window: Window, open_sent: Iterable[float], now: float, began: float | None, settle_s: float
    ) -> Side:
        """This side one look later; ``open_sent``: when the class's requests open on the worker were
        sent; ``began``: when the run of saturated scrapes the window opens in began, where known."""
        turned = self.turned_over
        if turned is None:
            if any(t < self.switched for t in open_sent):
                return self
            turned = now
        return Side(self.switched, turned, saturated_pace(window, turned, now, settle_s=settle_s, began=began))


@dataclass(frozen=True, slots=True)
class PendingBudget:
    """A budget set or moved whose check is not done yet."""

    entry_id: int
    cohort: Cohort
    opens: float  # the decision: requests sent from here on went with it
    before: Mapping[str, Any]  # the worker's window before it (:meth:`Window.summary`, while it had work)
    first_token_before_s: float | None  # the class's mean time to first token before it (None: not seen)
    run_began: float | None  # when the run of saturated scrapes at the decision began (None: none ran)
    sent_now: int  # the max_tokens the class's requests go with under it
    held_tokens: int | None  # what they went with before it (None: as asked): the side held back
    with_budget: Side
    held_back: Side | None = None  # None: the side with the budget is still read

    @classmethod
    def opened(
        cls,
        entry_id: int,
        cohort: Cohort,
        now: float,
        before: Mapping[str, Any],
        first_token_before_s: float | None,
        run_began: float | None,
        sent: tuple[int, int],
    ) -> PendingBudget:
        """A budget decided at ``now``; ``sent``: the ``max_tokens`` its requests went with before it,
        and go with now."""
        held = None if sent[0] == cohort.asked else sent[0]
        return cls(entry_id, cohort, now, before, first_token_before_s, run_began, sent[1], held, Side(now))

    def done(self, enough_s: float) -> bool:
        return self.held_back is not None and self.held_back.pace.seconds >= enough_s


_WITH = (
    "with the budget",
    "requests of the class sent before the budget were still open on the worker {:.1f} s after it",
)
_HELD = (
    "with the budget held back",
    "requests of the class sent with the budget were still open on the worker {:.1f} s after it was held back",
)


def _why_not(side: Side, words: tuple[str, str], now: float, *, settle_s: float, enough_s: float,
             window_s: float, turn_over_s: float) -> str | None:  # fmt: skip
    """Why ``side`` can no longer be measured (None: it still may be)."""
    if side.turned_over is None:
        return None if now - side.switched < turn_over_s else words[1].format(now - side.switched)
    if side.pace.seconds >= enough_s or now - side.turned_over < window_s:
        return None
    return (f"{words[0]}, the worker was saturated, its batch settled (a run's first {settle_s:g} s not counted), "
            f"for {side.pace.seconds:.1f} s of the {enough_s:g} s a measure needs, in the {window_s:g} s after "
            "its batch turned over")  # fmt: skip


def advance(
    pending: PendingBudget,
    window: Window,
    open_sent: Sequence[float],
    now: float,
    *,
    settle_s: float,
    enough_s: float,
    window_s: float,
    stay_s: float = 0.0,
) -> PendingBudget | str:
    """The check one look later (see the module's words): the side under way read again, the side held
    back begun once the side with the budget has ``enough_s`` (``held_back`` set: the caller holds the
    budget back from ``now``), or why it cannot be measured. ``open_sent``: when the class's requests
    open on the worker were sent; ``stay_s``: the longest a recent one of them stayed there (sent to
    answered): a side's batch turns over within ``window_s`` beyond it."""
    limits = {"settle_s": settle_s, "enough_s": enough_s, "window_s": window_s, "turn_over_s": window_s + stay_s}
    held = pending.held_back
    if held is None:
        side = pending.with_budget.read(window, open_sent, now, pending.run_began, settle_s)
        if side.pace.seconds >= enough_s:
            return replace(pending, with_budget=side, held_back=Side(now))
        why = _why_not(side, _WITH, now, **limits)
        return why or replace(pending, with_budget=side)
    side = held.read(window, open_sent, now, pending.with_budget.pace.run_began, settle_s)
    why = _why_not(side, _HELD, now, **limits)
    return why or replace(pending, held_back=side)


def longest_stay_s(workload: Sequence[Observed], cohort: Cohort) -> float:
    """The longest the cohort's answered requests in ``workload`` stayed on the worker, sent to answered."""
    return max((o.finished - o.sent for o in workload if cohort.of(o) and o.finished is not None), default=0.0)


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
    """A saturated pace as the journal quotes it."""
    rate = pace.tok_per_s
    return {"saturated_s": round(pace.seconds, 1), "saturated_throughput": None if rate is None else round(rate, 2)}


def _side_fields(side: Side | None, sent: int) -> dict[str, Any]:
    if side is None:
        return {"sent_max_tokens": sent}
    turned = None if side.turned_over is None else round(side.turned_over - side.switched, 1)
    return {"sent_max_tokens": sent, "turned_over_after_s": turned, **pace_fields(side.pace)}


def check_outcome(
    pending: PendingBudget, first_token_after_s: float | None, why: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The journal's outcome (``before``, ``with_budget``, ``held_back``, ``verdict``) and top-level
    figures of one budget's check: the pace with the budget over the pace held back
    (``measured_gain``), or ``why`` not (``not_measured``); the class's first-token times before the
    decision and with the budget."""
    fields: dict[str, Any] = {
        "first_token_before_s": _round(pending.first_token_before_s, 3),
        "first_token_after_s": _round(first_token_after_s, 3),
    }
    held = pending.held_back
    rate, base = pending.with_budget.pace.tok_per_s, None if held is None else held.pace.tok_per_s
    if why is None and not base:
        why = "the worker wrote nothing while saturated with the budget held back"
    if why is None and base and rate is not None:
        fields |= {"measured_throughput": round(rate, 1), "measured_gain": round(rate / base - 1.0, 4)}
    else:
        fields["not_measured"] = why
    sent_back = pending.cohort.asked if pending.held_tokens is None else pending.held_tokens
    with_budget, held_back = _side_fields(pending.with_budget, pending.sent_now), _side_fields(held, sent_back)
    outcome: dict[str, Any] = {"before": dict(pending.before), "with_budget": with_budget, "held_back": held_back}
    if "measured_gain" in fields:
        outcome["verdict"] = verdict({"throughput": base}, {"throughput": rate})
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
