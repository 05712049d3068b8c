"""The control loop: observe every worker, run the safety rules and the planner, act, journal it all.

Observation is synchronous and cheap: samples, log lines and pool states are pushed into each
worker's :class:`~proxy.control.window.Window`. :meth:`Controller.tick` (every ``interval_s``) runs
the safety net for serving workers, :meth:`Controller.plans_due` and :meth:`Controller.decide_plan`
the planner, :meth:`Controller.decide_revival` a death; all read windows and states only, so tests
drive them with recorded inputs. :meth:`Controller.run` ticks and carries acts out, one at a time.
Each worker is in one :class:`~proxy.control.phase.Phase`; the concerns are handlers of their own
(``revival.py``, ``trials.py``, ``planning.py``, ``outcomes.py``) over one shared ``Roster``.

Timing: every constant (``proxy.control.constants``) is in the engine's seconds; the controller
converts them with its workers' clock rate (a simulated worker's time scale, 1 for a real engine).

Modes (``[control] mode``): ``auto`` acts (rolling restarts), ``advise`` journals what it would do,
``off`` only observes. A worker this proxy does not manage is never restarted (advised instead).
A managed worker that dies is revived (unless ``revive = false``; not in ``off``) after a back-off
that grows with its recent deaths, in ``auto`` with the death rules' safer arguments.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from proxy.control.activations import Activations
from proxy.control.budget_gain import BudgetPrediction, predict_budget
from proxy.control.budgets import BudgetJob, Budgets
from proxy.control.canary import Canary
from proxy.control.constants import CONSTANTS, Constants
from proxy.control.decision import Action, ControlState, Decision, RuleKind
from proxy.control.economics import replayed_requests
from proxy.control.evidence import OutputBudget
from proxy.control.horizon import Backlog
from proxy.control.journal import Journal, Status
from proxy.control.offload import Offload, in_thread
from proxy.control.outcomes import (
    OutcomeJob,
    PendingOutcome,
    check_due,
    check_job,
    journal_outcome,
    outcome_fields,
)
from proxy.control.phase import Phase, Tracked
from proxy.control.planner import Looks, Outcome, Plan, Twin, check_outcome, run_plan
from proxy.control.planning import Planning
from proxy.control.ports import (
    Act,
    Actor,
    ActResult,
    DeathReport,
    DeclareDown,
    Drain,
    EngineLogs,
    LogReader,
    PlanJob,
    Surroundings,
    TrialRefused,
)
from proxy.control.reshaping import Reshaper, Reshaping, ShapeJob, run_shapes
from proxy.control.revival import Revival
from proxy.control.roster import Roster
from proxy.control.rules import (
    SAFETY_NET_SERVING,
    RuleSettings,
    activations_fit,
    before_launch,
    evaluate,
)
from proxy.control.shape import ShapeComparison
from proxy.control.suggestions import SUGGEST_EVERY_S, ChoiceArgs, decisions, facts_of, suggest
from proxy.control.trials import Trials
from proxy.control.window import Window
from proxy.engines.base import EventKind, Knob, KnobName, LogEvent, Modelled, Sample
from proxy.policy import ControlMode, ControlSettings
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState
from proxy.workers.exit_text import shorten_cause

__all__ = [
    "Act",
    "ActResult",
    "Actor",
    "Controller",
    "DeathReport",
    "DeclareDown",
    "Drain",
    "EngineLogs",
    "LogReader",
    "PlanJob",
    "Surroundings",
    "TrialRefused",
]

_log = logging.getLogger(__name__)
_Budgeting = tuple[BudgetJob, "asyncio.Future[BudgetPrediction | str]"]  # a budget's prediction off the loop
_Shaping = tuple[ShapeJob, "asyncio.Future[ShapeComparison | None]"]  # a look at the pool's shape off the loop
_DETAIL_CHARS = 1000  # a failed revival's detail, at most


class Controller:
    """One pool's control loop: its workers (each in one :class:`~proxy.control.phase.Phase`), their
    windows, and the handlers that decide on them."""

    def __init__(
        self,
        settings: ControlSettings,
        knobs: Mapping[KnobName, Knob],
        journal: Journal,
        *,
        engine: EngineLogs,
        surroundings: Surroundings,
        actor: Actor,
        clock: Callable[[], float],
        hold: Callable[[WorkerId], object],
        declare_down: DeclareDown | None = None,
        modelled: Callable[[Mapping[str, object]], Modelled] = lambda args: Modelled(),
        choice_args: ChoiceArgs = lambda choice, args: None,
        offload: Offload = in_thread,
        clock_rate: float = 1.0,
        constants: Constants = CONSTANTS,
        placement: Callable[[int], Mapping[str, object]] | None = None,
    ) -> None:
        self._offload = offload  # where the plans' and checks' replays run, off the event loop
        self._modelled = modelled  # the presets a simulated worker under these args models
        self._choice_args = choice_args  # the engine's arguments for a person's choice (suggested only)
        self._suggested_at: dict[WorkerId, float] = {}
        self._engine_constants = constants  # in the engine's seconds
        self._knobs = knobs
        self.clock_rate = clock_rate
        wall = constants.in_wall(clock_rate)  # on the clock the controller reads (the wall's)
        # the safety net foresees crashes from the twin's activations where the twin is the worker's GPU
        rules = RuleSettings(control=settings, knobs=knobs, activations=self._activations, constants=wall)
        # the twin is an SGLang model (its admission conservativeness among its knobs): on another engine
        # (vLLM) there is no plan, no launch forecast and no activations; its rules keep a preemption cap
        self._twin_models_engine = KnobName.CONSERVATIVENESS in knobs
        self._activations_seen: dict[tuple[tuple[str, str], ...], Activations | None] = {}
        self.engine = engine
        self.surroundings = surroundings
        self.actor = actor
        self._hold = hold  # send a worker nothing more until it starts again (the pool's hold)
        self._declare_down = declare_down  # tell the pool a dead worker stays down, or loops
        self._roster = Roster(settings=settings, journal=journal, clock=clock, constants=wall, rules=rules)
        self._workers = self._roster.workers  # the same dict: the roster's
        self._revival = Revival(self._roster, engine, surroundings)
        self._trials = Trials(self._roster)
        self._planning = Planning(self._roster, surroundings, self._trials, self._twin,
                                  twin_models_engine=self._twin_models_engine)  # fmt: skip
        self._budgets = Budgets(self._roster, surroundings, self._twin, twin_models_engine=self._twin_models_engine)
        # the pool's shape (workers x tp): ``placement`` gives the engine's flags for a tp (None: not reshaped)
        self._reshaping = Reshaping(self._roster, surroundings, self._twin, placement, self.track,
                                    twin_models_engine=self._twin_models_engine)  # fmt: skip
        self._tasks: set[asyncio.Task[None]] = set()
        self._checks: list[OutcomeJob] = []  # acted plans whose window is in, to check off the loop

    @property
    def settings(self) -> ControlSettings:
        return self._roster.settings

    @property
    def journal(self) -> Journal:
        return self._roster.journal

    @property
    def clock(self) -> Callable[[], float]:
        return self._roster.clock

    @property
    def constants(self) -> Constants:
        """On the clock the controller reads (the wall's): converted again when the clock rate changes."""
        return self._roster.constants

    @property
    def rules(self) -> RuleSettings:
        return self._roster.rules

    @property
    def canary(self) -> Canary | None:
        """A plan or an operator's trial tried on one worker of several, while it is judged."""
        return self._trials.canary

    def set_clock_rate(self, rate: float) -> None:
        """A worker said how fast its clock runs (an external simulated worker's server info): the
        constants are converted again, and the windows' spans with them."""
        if rate <= 0 or rate == self.clock_rate:
            return
        _log.info("controller: the workers' clock runs at %g x the wall's; constants converted", rate)
        self.clock_rate = rate
        self._roster.constants = self._engine_constants.in_wall(rate)
        self._roster.rules = replace(self._roster.rules, constants=self.constants)
        for w in self._workers.values():
            w.window = replace(w.window, span_s=self.constants.window_s)
            w.backlog = replace(w.backlog, memory_s=self.constants.plan_trend_s)

    def _twin(self, args: Mapping[str, object]) -> Twin:
        """The twin's presets for a worker under ``args``: a simulated worker's own; else the constants'
        (a real GPU's twin calibrates its step time and KV pool from the worker's own lines)."""
        k = self.constants
        modelled = self._modelled(args)
        return Twin(modelled.gpu or k.twin_gpu, modelled.model or k.twin_model)

    def _activations(self, args: Mapping[str, object]) -> Activations | None:
        """The twin's activations under ``args``, once per set of arguments (the rules ask every tick;
        ``activations_fit`` uses them only where the twin's KV pool is the one the worker reported)."""
        if not self._twin_models_engine:
            return None
        key = tuple(sorted((k, repr(v)) for k, v in args.items()))
        if key not in self._activations_seen:
            self._activations_seen[key] = self._twin(args).activations(args)
        return self._activations_seen[key]

    @property
    def mode(self) -> ControlMode:
        return self.settings.mode

    def launch_args(
        self, worker_id: WorkerId, args: Mapping[str, object], gpu_total_bytes: int | None = None
    ) -> dict[str, object]:
        """The arguments a managed worker's first launch takes: the start-up rules (the memory band,
        the activations) read on the twin's forecast of its start-up line, read by the engine's own
        log reader (:func:`proxy.control.rules.before_launch`), each move journaled. A forecast moves
        nothing a start-up line would not move once printed; it saves the start-up that reading the
        line after the launch costs. Advising, the moves are journaled and the worker starts as
        configured. Only where the twin's GPU is the worker's: the GPU a simulated worker models, or a
        GPU of the twin preset's size (``gpu_total_bytes``: NVML's total memory of the worker's GPU)."""
        if self.mode is ControlMode.OFF or not self._twin_models_engine:
            return dict(args)
        twin = self._twin(args)
        if self._modelled(args).gpu is not None:
            whose = "the GPU it models"
        elif gpu_total_bytes is not None and twin.is_gpu(gpu_total_bytes):
            whose = "the size NVML reports"
        else:
            return dict(args)
        now = self.clock()

        def forecast(candidate: Mapping[str, object]) -> list[LogEvent]:
            line = self._twin(candidate).startup_line(candidate)
            if line is None:
                return []
            reader = self.engine.log_reader()
            return [*reader.feed(line, now), *reader.flush(now)]

        decisions = before_launch(worker_id, args, forecast, self.rules, now, lambda a: self._twin(a).resolved(a))
        status = Status.APPLIED if self.mode is ControlMode.AUTO else Status.ADVISED
        for decision in decisions:
            self.journal.record(decision, mode=self.mode, status=status,
                                detail=f"before its first launch, on the twin's forecast of its start-up line "
                                f"({twin.model} on {twin.gpu}: {whose})")  # fmt: skip
        if status is not Status.APPLIED or not decisions:
            return dict(args)
        return dict(decisions[-1].new_args)

    def on_output_budget(self, worker_id: WorkerId, evidence: OutputBudget, now: float) -> None:
        """The fast tier set, moved or lifted a worker's output budget (no restart: it applies to the
        next request sent there): journaled with what it read."""
        w = self._workers.get(worker_id)
        args = dict(w.state.args) if w is not None else {}
        budget, before = evidence.budget_tokens, evidence.previous_tokens
        cls, asked = evidence.request_class, evidence.max_tokens
        if budget is None and evidence.reached is not None:
            reason = (
                f"{cls} output budget at max_tokens {asked} lifted (was {before}): {evidence.reached} of the "
                f"{evidence.reached + (evidence.ended_within or 0)} answers that ended or went on under it over the "
                "facts' window (the constants' facts_window_s) reached it, so answers are now longer; requests go as they ask, and those "
                "going on ask for the rest"
            )
        elif budget is None:
            reason = f"{cls} output budget at max_tokens {asked} lifted (was {before}): requests go as they ask"
        else:
            applies = evidence.applies_above_tokens is None or asked >= evidence.applies_above_tokens
            reason = (
                f"{cls} requests asking for max_tokens {asked} go with {budget if applies else asked}"
                + ("" if before is None else f" (budget was {before})")
                + f": {evidence.quantile:.0%} of the last {evidence.answers} such answers wrote at most "
                f"{evidence.high_tokens}, x {evidence.margin:g}"
                + ("; an answer that reaches it goes on" if applies else f" = {budget}, too close to what they ask")
            )
        decision = Decision(worker_id=worker_id, rule="output_budget", time=now, evidence=evidence, old_args=args,
                            new_args=args, action=Action.NOTE, kind=RuleKind.TUNING, reason=reason)  # fmt: skip
        entry_id = self.journal.record(decision, mode=self.mode, status=Status.APPLIED,
                                       detail="the fast tier: no restart, it applies to the next request")  # fmt: skip
        self._budgets.decided(worker_id, entry_id, evidence, now)

    def budget_predictions_due(self, limit: int | None = None) -> list[BudgetJob]:
        """Budgets set or moved whose gain the twin is to predict (at most ``limit``, the oldest first),
        each with what its replay reads (taken once; computed off the loop, :meth:`run`)."""
        return self._budgets.due(limit)

    def record_budget_prediction(self, job: BudgetJob, prediction: BudgetPrediction | str) -> None:
        """Journal a budget's predicted gain, or why there is none (:func:`~proxy.control.budget_gain.predict_budget`)."""
        self._budgets.record(job, prediction)

    # -- observation ------------------------------------------------------------------------------

    def track(self, info: WorkerInfo) -> None:
        """Follow a worker (idempotent); called for every state change the pool announces."""
        now = self.clock()
        w = self._workers.get(info.id)
        if w is None:
            reader = self.engine.log_reader() if info.managed else None
            ready = info.state is WorkerState.READY
            w = self._workers[info.id] = Tracked(
                state=ControlState.initial(info.id, dict(info.args), now if ready else None),
                window=Window(span_s=self.constants.window_s),
                reader=reader,
                managed=info.managed,
                phase=Phase.SERVING if ready else Phase.DOWN,
                backlog=Backlog(memory_s=self.constants.plan_trend_s),
            )
        w.pool_state = info.state
        if info.state is WorkerState.STARTING:
            w.window = w.window.restart(now)
            w.state = w.state.without_resolved()
            w.starting_at = now
            w.held_open = None  # the board forgets it with the process: the new one's looks price it anew
            w.queue_past = False  # likewise its queue's side of its engine's prefix limit
        held = w.phase is Phase.HELD
        up = info.state is WorkerState.READY or (info.state is WorkerState.DRAINING and held)
        if up and w.state.started_at is None:  # a held one is up too: the tick's rules restart it
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
            if w.phase in (Phase.DOWN, Phase.HELD):  # not acting: a revival's restart still is
                w.move(Phase.SERVING)
        if w.phase is Phase.HELD and info.state is not WorkerState.STARTING:
            w.move(Phase.DOWN)  # gone before it came up
        if up and w.starting_at is not None:
            w.startup_s, w.starting_at = now - w.starting_at, None
        if info.state is WorkerState.DOWN and w.managed and w.phase is not Phase.ACTING and not info.stays_down:
            self._on_death(info.id, info.exit_code, info.last_error)

    def on_sample(self, worker_id: WorkerId, sample: Sample | None, error: str | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is None or sample is None:
            return
        held = self.surroundings.backlog()
        w.window = w.window.push(sample).push_proxy_queue(sample.time, held, self.surroundings.held_for_class())
        sharing = self._roster.serving_count()
        waiting = sample.queue + held / sharing
        w.backlog = w.backlog.observe(sample.time, waiting, running=sample.running, sharing=sharing,
                                      full=sample.token_usage >= self.constants.low_usage)  # fmt: skip

    def on_line(self, worker_id: WorkerId, line: str) -> None:
        w = self._workers.get(worker_id)
        if w is None or w.reader is None:
            return
        for event in w.reader.feed(line, self.clock()):
            self.on_event(worker_id, event)

    def on_event(self, worker_id: WorkerId, event: LogEvent) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.window = w.window.push(event)
        if event.kind is EventKind.STARTUP and self._crash_foreseen(w):
            # the start-up line says the arguments will crash once work arrives: the worker comes up held
            # (it takes no request), and the first tick restarts it with the arguments that fit (one the pool
            # restarted by itself while it served stays serving: the tick's rules act on it as they read it)
            if w.phase is Phase.DOWN:
                w.move(Phase.HELD)
            self._hold(worker_id)
        if event.kind in (EventKind.OOM, EventKind.CRASH) and w.managed:
            # the server is going down (an OOM or a scheduler exception kills it): send it nothing more,
            # so requests are not retried against its closing port; its exit and restart lift the hold
            self._hold(worker_id)

    def _crash_foreseen(self, w: Tracked) -> bool:
        """A starting worker (not one the controller is restarting), managed, under ``auto`` with the
        planner, whose start-up line the safety net's forecast (``activations_fit``) would act on now."""
        if not (w.managed and self.mode is ControlMode.AUTO) or w.phase is Phase.ACTING:
            return False  # a restart under way waits for its own worker to come up READY
        if w.pool_state is not WorkerState.STARTING:
            return False
        return evaluate(w.window, w.state, self.rules, (activations_fit,)).decision is not None

    def window(self, worker_id: WorkerId) -> Window:
        return self._workers[worker_id].window

    def backlog(self, worker_id: WorkerId) -> Backlog:
        """Work waiting for the worker without a break, as of its latest look."""
        return self._workers[worker_id].backlog

    def state(self, worker_id: WorkerId) -> ControlState:
        return self._workers[worker_id].state

    def phase(self, worker_id: WorkerId) -> Phase:
        """Where the worker stands for the controller (:class:`~proxy.control.phase.Phase`)."""
        return self._workers[worker_id].phase

    def set_resolved(self, worker_id: WorkerId, values: Mapping[str, float]) -> None:
        """Values the engine chose for unset args (e.g. from its ``/server_info``)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.state = w.state.with_resolved(values)

    # -- decisions (synchronous) ------------------------------------------------------------------

    def tick(self) -> list[Act]:
        """Run the serving rules for every serving worker; returns the acts for ``auto`` to carry out."""
        now = self.clock()
        acts: list[Act] = []
        others_down = self._roster.down_besides()
        for w in self._workers.values():
            w.window = w.window.at(now)
        canary_act = self._trials.step(now, others_down)
        if canary_act is not None:
            acts.append(canary_act)
            others_down = True
        for w in self._workers.values():
            self._measure_outcome(w, now)
            self._budgets.measure(w, now)
            self._check_when_answered(w, now)
            since = w.serving_since
            if since is None:
                continue
            if w.state.last_good_args != w.state.args and now - since >= self.constants.good_after_s:
                w.state = w.state.mark_good()
            if self.mode is ControlMode.OFF or self._reshaping.under_way:  # a reshape replaces the workers
                continue
            self._suggest(w, now)
            act = self._safety_net(w, now, others_down)
            if act is not None:
                others_down = True
                acts.append(act)
        return acts

    def _suggest(self, w: Tracked, now: float) -> None:
        """Journal what a person should choose for this worker (once a window, each at most once per
        :data:`~proxy.control.suggestions.SUGGEST_EVERY_S`)."""
        worker_id = w.state.worker_id
        last = self._suggested_at.get(worker_id)
        if w.window.observed_s < self.constants.min_evidence_s or (
            last is not None and now - last < self.constants.window_s
        ):
            return
        self._suggested_at[worker_id] = now
        args = w.state.args
        found = suggest(facts_of(w.window, self._twin(args), args), args, self._choice_args, self._knobs,
                        twin_prices_levers=self._twin_models_engine)  # fmt: skip
        for decision in decisions(worker_id, now, args, found):
            key = f"suggest:{getattr(decision.evidence, 'option', '')}"
            self._roster.journal_once(
                w, decision, key, now, status=Status.NOTED, span=SUGGEST_EVERY_S / self.clock_rate
            )

    def _safety_net(self, w: Tracked, now: float, others_down: bool) -> Act | None:
        """The serving rules on one serving worker: refusals and notes journaled (once per span), advice
        where it is not acted on, a wait while another worker restarts, else the act."""
        journal_once = self._roster.journal_once
        evaluation = evaluate(w.window, w.state, self.rules, SAFETY_NET_SERVING)
        for decision, why in evaluation.refused:
            journal_once(w, decision, f"refused:{decision.rule}:{why.split(':')[0]}", now, status=Status.REFUSED,
                         detail=why)  # fmt: skip
        chosen = evaluation.decision
        if chosen is None:
            return None
        if chosen.action is Action.NOTE:
            if not (chosen.rule == "pacing_too_timid" and w.held_open is not None):  # held at its graphs by design
                journal_once(w, chosen, f"note:{chosen.rule}", now, status=Status.NOTED, span=self.constants.window_s)
            return None
        if self.mode is ControlMode.ADVISE or not w.managed:
            why = "" if self.mode is ControlMode.ADVISE else "worker is not managed by this proxy"
            journal_once(w, chosen, f"advise:{chosen.rule}", now, status=Status.ADVISED, detail=why)
            return None
        if others_down and len(self._workers) > 1:
            journal_once(w, chosen, f"wait:{chosen.rule}", now, status=Status.REFUSED,
                         detail="another worker is restarting or down: one at a time")  # fmt: skip
            return None
        entry_id = self.journal.record(chosen, mode=self.mode, status=Status.ACTING, before=w.window.summary())
        w.move(Phase.ACTING)
        return Act(decision=chosen, entry_id=entry_id)

    # -- the planner (synchronous halves, ``planning.py``; the replays run off the loop in between) --

    def plans_due(self, limit: int | None = None) -> list[PlanJob]:
        """Workers due a plan (at most ``limit``, the longest since its last plan first: one plan at a time,
        a fleet's first workers would otherwise be due again before its last one's turn; a worker whose
        paying restart waited for another worker's goes first, due as soon as the fleet is whole): serving,
        managed (or advised), enough evidence, outside the cool-down and the restart budget; each with
        what its plan reads."""
        if self._reshaping.under_way:  # the pool's workers are being replaced: no plan of one of them
            return []
        return self._planning.due(limit)

    def plan_now(self, job: PlanJob) -> Act | None:
        """Compute ``job`` here (tests, and callers without a loop) and decide on it."""
        return self.decide_plan(job, run_plan(job.inputs))

    def decide_plan(self, job: PlanJob, plan: Plan) -> Act | None:
        """Turn a plan into an act (``auto``, managed, it pays), a journal entry, or nothing (a plan
        computed while the pool is reshaped: of a worker that is going)."""
        if self._reshaping.under_way:
            w = self._workers.get(job.worker_id)
            if w is not None:
                w.plan_done()
            return None
        return self._planning.decide(job, plan, reshape_pending=self._reshaping.pending)

    # -- trials (``trials.py``) and revivals (``revival.py``) -----------------------------------------

    def trial(self, worker_id: WorkerId, args: Mapping[str, object], *, note: str = "") -> Act:
        """An operator's trial: ``args`` (merged over the worker's own) tried on ``worker_id`` as a
        canary, journalled like a plan (reason "operator trial") and judged, promoted, kept or
        reverted by the same canary code. Returns the act to carry out (the caller starts it);
        raises :class:`TrialRefused` (in words) when it cannot start now."""
        return self._trials.trial(worker_id, args, note=note)

    def start_trial(self, worker_id: WorkerId, args: Mapping[str, object], *, note: str = "") -> int:
        """:meth:`trial`, carried out in the background (the proxy's admin endpoint); returns its journal id."""
        act = self.trial(worker_id, args, note=note)
        self._spawn(self.carry_out(act))
        return act.entry_id

    def decide_revival(
        self, worker_id: WorkerId, exit_code: int | None = None, last_error: str | None = None
    ) -> Act | None:
        """A managed worker died: the revival to carry out, or None (:meth:`Revival.decide
        <proxy.control.revival.Revival.decide>`)."""
        return self._revival.decide(worker_id, exit_code, last_error)

    # -- outcomes (``outcomes.py``) ---------------------------------------------------------------

    def _measure_outcome(self, w: Tracked, now: float) -> None:
        """Journal the last restart's outcome window once it is in; an acted plan's check waits next."""
        pending = w.pending_outcome
        if (
            pending is None
            or w.phase is Phase.ACTING
            or not pending.is_in(w.window, self.constants.min_evidence_s, now)
        ):
            return
        w.pending_outcome = None
        check = journal_outcome(pending, w.window, self.journal, self.constants)
        if check is not None:
            w.pending_check = check

    def _check_when_answered(self, w: Tracked, now: float) -> None:
        """Queue the check of the worker's last acted plan once it is due (:func:`~proxy.control.outcomes.check_due`)."""
        pending = w.pending_check
        if pending is None:
            return
        wid = w.state.worker_id
        workload = tuple(self.surroundings.recent_requests(wid))
        sample = replayed_requests(self.constants.plan_requests, w.window.peak_running)  # as many as a plan replays
        if not check_due(pending, workload, w.serving, now, sample):
            return
        w.pending_check = None
        in_flight = tuple(self.surroundings.in_flight(wid))
        self._checks.append(check_job(wid, pending, workload, in_flight, now, sample))

    def outcomes_due(self, limit: int | None = None) -> list[OutcomeJob]:
        """Acted plans whose check is due (:meth:`_check_when_answered`; at most ``limit``, the oldest
        first), each with the requests it is checked on (taken once)."""
        taken = len(self._checks) if limit is None else limit
        jobs, self._checks = self._checks[:taken], self._checks[taken:]
        return jobs

    def record_outcome(self, job: OutcomeJob, outcome: Outcome) -> None:
        """Journal how the plan's twin did on the requests served under its args (:func:`~proxy.control.outcomes.outcome_fields`)."""
        self.journal.update(job.entry_id, fields=outcome_fields(outcome))

    # -- acting (async) ---------------------------------------------------------------------------

    def _on_death(self, worker_id: WorkerId, exit_code: int | None, last_error: str | None) -> None:
        """Decide the revival and carry it out; tell the pool when the worker stays down, or is in a
        crash loop no rule breaks (the request path refuses its requests instead of queueing them)."""
        act = self.decide_revival(worker_id, exit_code, last_error)
        if act is not None:
            self._spawn(self.carry_out(act))
        if self._declare_down is None:
            return
        if act is None:
            why = "control.mode = off" if self.mode is ControlMode.OFF else "control.revive = false"
            self._declare_down(worker_id, f"it stays down ({why})")
        elif act.decision.rule == "revive" and (state := self._workers[worker_id].state).crash_loop_noted:
            window = self.constants.crash_loop_window_s
            deaths = state.deaths_within(self.clock(), window)
            self._declare_down(
                worker_id,
                f"in a crash loop ({deaths} deaths in {window:g} s): revived after each death, it serves once it starts",
                for_good=False,
            )

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled; acts run one at a time.

        A plan's replays are CPU-bound and take seconds on a busy host, one worker's plan after
        another: they run off the event loop (``offload``; in the app, a process of their own, so
        they do not hold the interpreter's lock against the relaying) while the ticks go on (a
        canary's fail-fast, the rules, the outcome windows do not wait for the other workers'
        plans), one plan at a time, and a plan is decided on the first tick after it is in
        (:meth:`decide_plan`, which drops it if its worker restarted meanwhile). The checks of acted plans replay too: off the loop, one at a
        time, beside the plan, each journaled on the first tick after it is in; and so do the predictions
        of the output budgets' gains (:meth:`_predict_budgets`)."""
        computing: tuple[PlanJob, asyncio.Future[Plan]] | None = None
        shaping: _Shaping | None = None
        checking: tuple[OutcomeJob, asyncio.Future[Outcome]] | None = None
        predicting: _Budgeting | None = None
        try:
            while True:
                for act in self.tick():
                    await self.carry_out(act)
                predicting = self._predict_budgets(predicting)
                if checking is not None and checking[1].done():
                    (check, done), checking = checking, None
                    try:
                        self.record_outcome(check, done.result())
                    except Exception as exc:
                        _log.warning("outcome check of decision #%d failed: %s", check.entry_id, exc)
                if checking is None:
                    for check in self.outcomes_due(limit=1):
                        checking = (check, asyncio.ensure_future(self._offload(check_outcome, check.inputs)))
                if computing is not None and computing[1].done():
                    (job, computed), computing = computing, None
                    planned = self._decide_computed(job, computed)
                    if planned is not None:
                        await self.carry_out(planned)
                if computing is None:
                    for job in self.plans_due(limit=1):
                        self._workers[job.worker_id].move(Phase.PLANNING)
                        computing = (job, asyncio.ensure_future(self._offload(run_plan, job.inputs)))
                shaping = self._look_at_shape(shaping)
                await asyncio.sleep(self.constants.interval_s)
        finally:
            for running in (computing, checking, predicting, shaping):
                if running is not None:
                    running[1].cancel()  # what it computes is dropped (its process or thread ends it by itself)
            await self.close()

    def _look_at_shape(self, shaping: _Shaping | None) -> _Shaping | None:
        """Decide on the pool's shape once its prices are in (a reshape runs beside the ticks: its
        canary is judged on windows they move), and start the next look when one is due."""
        if shaping is not None and shaping[1].done():
            (job, done), shaping = shaping, None
            try:
                act = self._reshaping.decide(job, done.result())
            except Exception as exc:
                _log.warning("pricing the pool's shapes failed: %s", exc)
                act = None
            reshaper = self.actor if isinstance(self.actor, Reshaper) else None
            if act is not None and reshaper is not None:
                self._spawn(self._reshaping.carry_out(act, reshaper))
            elif act is not None:
                self._reshaping.under_way = False
                self.journal.update(act.entry_id, status=Status.FAILED, detail="this pool cannot be reshaped")
        look = self._reshaping.due() if shaping is None else None
        if look is not None:
            shaping = (look, asyncio.ensure_future(self._offload(run_shapes, look.inputs)))
        return shaping

    def shapes_due(self) -> ShapeJob | None:
        """A look at the pool's shape, when one is due (:meth:`Reshaping.due`)."""
        return self._reshaping.due()

    def decide_shape(self, job: ShapeJob, comparison: ShapeComparison | None) -> Act | None:
        """Journal a look at the pool's shape; the reshape to carry out, if any (:meth:`Reshaping.decide`)."""
        return self._reshaping.decide(job, comparison)

    def _predict_budgets(self, predicting: _Budgeting | None) -> _Budgeting | None:
        """Journal the budget prediction computed off the loop, once it is in, and start the next."""
        if predicting is not None and predicting[1].done():
            (job, done), predicting = predicting, None
            try:
                prediction = done.result()
            except Exception as exc:
                _log.warning("prediction of output budget #%d failed: %s", job.entry_id, exc)
                prediction = f"the twin's replay failed: {exc.__class__.__name__}: {exc}"
            self.record_budget_prediction(job, prediction)
        if predicting is None:
            for job in self.budget_predictions_due(limit=1):
                predicting = (job, asyncio.ensure_future(self._offload(predict_budget, job.inputs)))
        return predicting

    def _decide_computed(self, job: PlanJob, computed: asyncio.Future[Plan]) -> Act | None:
        """Decide on a plan computed off the loop (a failed one is logged, its worker free to plan again)."""
        try:
            plan = computed.result()
        except Exception as exc:
            w = self._workers.get(job.worker_id)
            if w is not None:
                w.plan_done()
            _log.warning("plan for %s failed: %s", job.worker_id, exc)
            return None
        return self.decide_plan(job, plan)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def carry_out(self, act: Act) -> None:
        """Restart (or revive) the worker through the actor, then journal how it came back."""
        d = act.decision
        w = self._workers[d.worker_id]
        try:
            if d.delay_s > 0:
                await asyncio.sleep(d.delay_s)
            w.window = w.window.restart(self.clock())
            call = self.actor.revive if act.revival else self.actor.restart
            result = await call(d.worker_id, d.new_args, d.reason)
        except asyncio.CancelledError:
            self.journal.update(act.entry_id, status=Status.FAILED, detail="cancelled (the proxy is stopping)")
            raise
        except Exception as exc:  # a refused restart (bad args, external worker): keep serving as before
            _log.warning("restart of %s for %s failed: %s", d.worker_id, d.rule, exc)
            self.journal.update(act.entry_id, status=Status.FAILED, detail=f"{exc.__class__.__name__}: {exc}")
            w.move(Phase.SERVING if w.state.started_at is not None else Phase.DOWN)  # as it was, or up meanwhile
            self._trials.came_back(act.entry_id, None)  # refused before the worker stopped: nothing to judge
            return
        now = self.clock()
        info = result.info
        if result.drain is not None:
            w.drain_s = result.drain.drain_s
        w.state = w.state.after_restart(d, now, self.constants.flip_guard_s)
        w.looks = Looks()  # whatever restarted it, its plans are read afresh on its new arguments
        details = result.drain.to_json() if result.drain is not None else None
        if info.state is WorkerState.READY:
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
            w.move(Phase.SERVING)
            status = Status.REVIVED if act.revival and d.rule == "revive" else Status.APPLIED
            self.journal.update(
                act.entry_id, status=status, detail=f"{d.worker_id} ready (pid {info.pid})", act=details
            )
            opens = now + act.settle_s
            w.pending_outcome = PendingOutcome(act.entry_id, opens, opens + self.constants.window_s, act.expectation,
                                               ready=now)  # fmt: skip
            self._trials.came_back(act.entry_id, opens)
        else:
            w.move(Phase.DOWN)
            detail = f"{d.worker_id} is {info.state}: " + shorten_cause(info.last_error or "", _DETAIL_CHARS)
            self.journal.update(act.entry_id, status=Status.FAILED, detail=detail, act=details)
            self._trials.came_back(act.entry_id, None)  # the canary did not come back: its death's rules take over
            if info.state is WorkerState.DOWN:
                self._on_death(d.worker_id, info.exit_code, info.last_error)
