"""The output budgets' predicted and measured gains, around the fast tier's decisions.

The fast tier sets, moves and lifts budgets with no restart; the controller journals each
(:meth:`~proxy.control.controller.Controller.on_output_budget`). :meth:`Budgets.decided` then gathers
what the twin's prediction of a budget set or moved reads (:class:`BudgetJob`, replayed off the loop
as plans are: :func:`~proxy.control.budget_gain.predict_budget`) and leaves its outcome window
pending on the worker; :meth:`Budgets.record` journals the prediction and :meth:`Budgets.measure`
steps the budget's check (its pace with the budget, then held back a while through the
surroundings: :mod:`proxy.control.budget_outcome`) and journals the measured gain. Only ``auto``
holds a budget back: another mode says why it is not measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.control.budget_gain import BudgetInputs, BudgetPrediction, Cohort
from proxy.control.budget_outcome import (
    PendingBudget,
    advance,
    check_outcome,
    first_token_s,
    judged,
    longest_stay_s,
    pace_fields,
)
from proxy.control.evidence import OutputBudget
from proxy.control.phase import Tracked
from proxy.control.planner import Twin
from proxy.control.planning import decode_stats, kv_capacity
from proxy.control.ports import Surroundings
from proxy.control.roster import Roster
from proxy.control.saturation import saturated_pace
from proxy.policy import ControlMode
from proxy.workers.base import WorkerId

__all__ = ["BudgetJob", "Budgets", "prediction_fields"]


@dataclass(frozen=True, slots=True)
class BudgetJob:
    """The prediction of one budget's gain (:func:`~proxy.control.budget_gain.predict_budget` on ``inputs``)."""

    worker_id: WorkerId
    entry_id: int
    inputs: BudgetInputs


def prediction_fields(p: BudgetPrediction | str) -> dict[str, Any]:
    """The journal's figures of a budget's prediction, or why there is none (``not_predicted``)."""
    if isinstance(p, str) or p.ratio is None:
        return {"not_predicted": p if isinstance(p, str) else "the twin gave no figure"}
    fields: dict[str, Any] = {"predicted_ratio": round(p.ratio, 4), "predicted_gain": round(p.ratio - 1.0, 4),
                              "prediction_requests": p.requests, "prediction_cohort": p.cohort}  # fmt: skip
    if p.budget_tok_per_s is not None and p.before_tok_per_s is not None:
        fields |= {
            "predicted_throughput": round(p.budget_tok_per_s, 1),
            "predicted_current": round(p.before_tok_per_s, 1),
        }
    if p.twin_error is not None:
        fields["twin_error"] = round(p.twin_error, 4)
    return fields


class Budgets:
    """The budgets' gains for the roster's workers; ``twin`` gives the twin's presets for a worker's
    args, ``twin_models_engine`` whether the twin models this engine at all (no prediction where not)."""

    def __init__(
        self,
        roster: Roster,
        surroundings: Surroundings,
        twin: Callable[[Mapping[str, object]], Twin],
        *,
        twin_models_engine: bool,
    ) -> None:
        self._roster = roster
        self._surroundings = surroundings
        self._twin = twin
        self._twin_models_engine = twin_models_engine
        self._jobs: list[BudgetJob] = []

    def decided(self, worker_id: WorkerId, entry_id: int, evidence: OutputBudget, now: float) -> None:
        """A budget journaled as ``entry_id``: one still measured under the same key is not (the budget
        changed again); one set or moved is predicted and its check begun."""
        w = self._roster.workers.get(worker_id)
        if w is None:
            return
        cohort = Cohort(evidence.request_class == "interactive", evidence.max_tokens)
        c = self._roster.constants
        earlier = w.pending_budgets.get(cohort)
        if earlier is not None:
            changed = "lifted" if evidence.budget_tokens is None else "moved again"
            self._end(w, earlier, now, f"the budget was {changed} (#{entry_id}) before its check was done")
        if evidence.budget_tokens is None:  # lifted: requests go as they ask
            return
        workload = tuple(self._surroundings.recent_requests(worker_id))
        in_flight = tuple(self._surroundings.in_flight(worker_id))
        # its saturated pace before it, back as far as the facts the budget was set on (the journal's context)
        pace = saturated_pace(
            w.window, now - c.facts_window_s, now, settle_s=c.min_evidence_s, enough_s=c.min_evidence_s
        )
        before = {**w.window.busy().summary(), **pace_fields(pace)}
        self._roster.journal.update(entry_id, outcome={"before": before})
        classes = {o.interactive for o in workload} | {r.interactive for r in in_flight}
        others = (not cohort.interactive) in classes
        why = self._unmeasurable(w.serving, evidence, beside_another_class=others)
        if why is not None:
            self._journal(entry_id, {"not_measured": why})
        else:
            first = first_token_s(workload, cohort.interactive, now - c.window_s, now)
            sent = (evidence.sent_before, evidence.sent_now)
            w.pending_budgets[cohort] = PendingBudget.opened(entry_id, cohort, now, before, first, pace.run_began, sent)
        if not self._twin_models_engine:
            self._journal(entry_id, {"not_predicted": "the twin does not model this engine's workers"})
            return
        args = dict(w.state.args)
        twin = self._twin(args)
        inputs = BudgetInputs(gpu=twin.gpu, model=twin.model, args=args, decode=decode_stats(w.window),
                              kv_capacity_tokens=kv_capacity(w.window), workload=workload,
                              in_flight=in_flight, now=now,
                              max_requests=c.plan_requests, horizon_s=c.plan_horizon_s, cohort=cohort,
                              before=evidence.sent_before, budget=evidence.sent_now)  # fmt: skip
        self._jobs.append(BudgetJob(worker_id, entry_id, inputs))

    def _unmeasurable(self, serving: bool, evidence: OutputBudget, *, beside_another_class: bool) -> str | None:
        """Why a budget just set or moved will not be measured (None: its check begins). Beside another
        class the worker's pace is not the budget's alone, and holding it back would cost the other
        class too (an interactive class's first tokens wait for the room it frees)."""
        if not serving:
            return "the worker is not serving"
        if evidence.sent_now == evidence.sent_before:
            return f"its requests go with max_tokens {evidence.sent_now} as before it"
        if beside_another_class:
            return "the worker serves another class beside it: its pace is not this budget's alone"
        if self._roster.mode is not ControlMode.AUTO:
            return f"its measure holds the budget back a while, which control.mode {self._roster.mode} does not do"
        return None

    def due(self, limit: int | None = None) -> list[BudgetJob]:
        """Predictions to compute (at most ``limit``, the oldest first), each taken once."""
        taken = len(self._jobs) if limit is None else limit
        jobs, self._jobs = self._jobs[:taken], self._jobs[taken:]
        return jobs

    def record(self, job: BudgetJob, prediction: BudgetPrediction | str) -> None:
        """Journal a budget's prediction, or why there is none (and, where its window is in already,
        whether it met it)."""
        self._journal(job.entry_id, prediction_fields(prediction))

    def measure(self, w: Tracked, now: float) -> None:
        """Step each pending budget's check (:func:`~proxy.control.budget_outcome.advance`): hold the
        budget back once the side with it is read, journal the gain once the side held back is, or why
        not (the worker stopped serving under it meanwhile: a restart, a death)."""
        c = self._roster.constants
        wid = w.state.worker_id
        for cohort, pending in list(w.pending_budgets.items()):
            if not w.serving or w.window.since > pending.opens:
                self._end(w, pending, now, "the worker restarted or stopped before its check was done")
                continue
            open_sent = [r.sent for r in self._surroundings.in_flight(wid) if cohort.of(r)]
            stay = longest_stay_s(self._surroundings.recent_requests(wid), cohort)
            step = advance(pending, w.window, open_sent, now, settle_s=c.min_evidence_s, enough_s=c.min_evidence_s,
                           window_s=c.window_s, stay_s=stay)  # fmt: skip
            if isinstance(step, str):
                self._end(w, pending, now, step)
                continue
            w.pending_budgets[cohort] = step
            if pending.held_back is None and step.held_back is not None:
                self._surroundings.hold_back_budget(wid, cohort.interactive, cohort.asked, step.held_tokens)
            if step.done(c.min_evidence_s):
                self._end(w, step, now)

    def _end(self, w: Tracked, pending: PendingBudget, now: float, why: str | None = None) -> None:
        """The check is over: the budget applies again where it was held back, and its outcome (its gain,
        or ``why`` not) is journaled."""
        cohort = pending.cohort
        del w.pending_budgets[cohort]
        if pending.held_back is not None:
            self._surroundings.release_budget(w.state.worker_id, cohort.interactive, cohort.asked)
        until = now if pending.held_back is None else pending.held_back.switched
        workload = self._surroundings.recent_requests(w.state.worker_id)
        first = first_token_s(workload, cohort.interactive, pending.opens, until)
        outcome, fields = check_outcome(pending, first, why)
        self._journal(pending.entry_id, fields, outcome)

    def _journal(self, entry_id: int, fields: Mapping[str, Any], outcome: Mapping[str, Any] | None = None) -> None:
        """Update the entry, and judge its prediction where it now holds both gains."""
        journal = self._roster.journal
        entry = journal.update(entry_id, fields=fields, outcome=outcome)
        if entry is not None and (verdict := judged(entry, self._roster.constants.plan_min_gain)):
            journal.update(entry_id, fields=verdict)
