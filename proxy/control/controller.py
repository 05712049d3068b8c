"""The control loop: observe every worker, run the safety rules and the planner, act, journal it all.

Observation is synchronous and cheap: samples, log lines and pool states are pushed into each
worker's :class:`~proxy.control.window.Window`. :meth:`Controller.tick` (every ``interval_s``) runs
the safety net for serving workers, :meth:`Controller.plans_due` and :meth:`Controller.decide_plan`
the planner, :meth:`Controller.decide_revival` a death; all read windows and states only, so tests
drive them with recorded inputs. :meth:`Controller.run` ticks and carries acts out, one at a time.

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
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.control.canary import Canary, CanaryVerdict, failing, judge, pays_above, share
from proxy.control.constants import CONSTANTS, Constants
from proxy.control.decision import Action, ControlState, Decision, KnobChange, RuleKind
from proxy.control.evidence import Death, OutputBudget, Planned
from proxy.control.horizon import Backlog, Horizon, answer_rate, expected_horizon
from proxy.control.journal import Journal, Status, verdict
from proxy.control.offload import Offload, in_thread
from proxy.control.planner import (
    DecodeStats,
    Expectation,
    InFlight,
    Looks,
    Observed,
    Outcome,
    OutcomeInputs,
    Plan,
    PlanInputs,
    PlanSettings,
    RestartCost,
    Twin,
    check_outcome,
    run_plan,
)
from proxy.control.ports import (
    Act,
    Actor,
    ActResult,
    DeathReport,
    DeclareDown,
    Drain,
    EngineLogs,
    PlanJob,
    Surroundings,
    TrialRefused,
)
from proxy.control.rules import (
    ON_DEATH,
    SAFETY_NET_SERVING,
    Activations,
    RuleSettings,
    activations_fit,
    before_launch,
    crash_loop_unbroken,
    evaluate,
    gate,
    revive_delay,
)
from proxy.control.window import Window
from proxy.engines.base import EventKind, Knob, KnobName, LogEvent, Modelled, Sample
from proxy.engines.contract import LogReader
from proxy.policy import ControlMode, ControlSettings
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState
from proxy.workers.exit_text import how_it_ended, shorten_cause

__all__ = [
    "Act",
    "ActResult",
    "Actor",
    "Controller",
    "DeathReport",
    "Drain",
    "EngineLogs",
    "LogReader",
    "PlanJob",
    "Surroundings",
    "TrialRefused",
]

_log = logging.getLogger(__name__)
_TAIL_LINES = 300
_DEATH_CHARS = 500  # a death's cause in words, at most (how it ended kept, what it said cut at its front: a dying process says why last)
_DETAIL_CHARS = 1000  # a failed revival's detail, at most


@dataclass(slots=True)
class _Worker:
    state: ControlState
    window: Window
    reader: LogReader | None  # None: not managed, no log to read
    managed: bool
    busy: bool = False  # an act or a revival is under way
    pending_outcome: PendingOutcome | None = None  # the last restart's, until its window is in
    pending_check: PendingCheck | None = None  # the last acted plan's twin, until enough is answered
    starting_at: float | None = None  # when its current start began (to measure the start-up)
    startup_s: float | None = None  # its last start-up, launch to ready, as seen
    drain_s: float = 0.0  # its last drain before a restart
    last_plan: float = float("-inf")
    planning: bool = False  # a plan is being computed off the loop
    looks: Looks = field(default_factory=Looks)  # what its plans under the current args said (a restart: afresh)
    pool_state: WorkerState = WorkerState.READY  # as the pool last announced it
    held_at_start: bool = False  # its start-up line foresaw a crash: held, it comes up DRAINING for the restart
    # work waiting for it without a break (kept across its restarts: it is the traffic's)
    backlog: Backlog = field(default_factory=Backlog)


@dataclass(frozen=True, slots=True)
class PendingOutcome:
    """A restart whose outcome window is not in yet."""

    entry_id: int
    opens: float  # the worker serves again and has computed again what it took back
    due: float  # the window is in
    expectation: Expectation | None = None  # an acted plan's: checked on the requests served since ``opens``
    ready: float | None = None  # the restarted worker was ready here


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


def _plan_reason(job: PlanJob, plan: Plan) -> str:
    """The plan's reason, with its horizon in words where the traffic said something about it."""
    horizon = job.horizon
    told = horizon.basis != "configured" or 0 < plan.accrues_s < horizon.seconds  # the traffic said something
    return f"{plan.reason}; {horizon.describe()}" if told else plan.reason


def _planned(job: PlanJob, plan: Plan) -> Planned:
    """The journal's evidence of a plan: what the twin predicts, what it weighed, what the worker measured."""
    return Planned(
        predicted_throughput=round(plan.best.output_tok_per_s, 2),
        predicted_current=round(plan.current.output_tok_per_s, 2),
        measured_throughput=round(job.measured_throughput, 2) if job.measured_throughput is not None else None,
        predicted_queue_s=round(plan.best.mean_queue_s, 3) if plan.best.mean_queue_s is not None else None,
        gain_tokens=round(plan.gain_tokens), cost_tokens=round(plan.cost_tokens),
        horizon_s=round(job.inputs.settings.horizon_s, 1),
        accrues_s=round(plan.accrues_s, 1),
        horizon=job.horizon.evidence(),
        step_time_factor=round(plan.twin.step_time_factor, 5), kv_factor=round(plan.twin.kv_factor, 4),
        replayed_requests=min(len(job.inputs.workload), job.inputs.settings.max_requests), replays=plan.replays,
        basis=plan.basis, wait_saved_s=round(plan.wait_saved_s), wait_cost_s=round(plan.wait_cost_s),
        utilization=None if plan.utilization is None else round(plan.utilization, 3),
        predicted_answer_s=None if plan.best.mean_answer_s is None else round(plan.best.mean_answer_s, 3),
        current_answer_s=None if plan.current.mean_answer_s is None else round(plan.current.mean_answer_s, 3),
    )  # fmt: skip


class Controller:
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
        offload: Offload = in_thread,
        clock_rate: float = 1.0,
        constants: Constants = CONSTANTS,
    ) -> None:
        self.settings = settings
        self._offload = offload  # where the plans' and checks' replays run, off the event loop
        self._modelled = modelled  # the presets a simulated worker under these args models
        self._engine_constants = constants  # in the engine's seconds
        self._knobs = knobs
        self.clock_rate = clock_rate
        self.constants = constants.in_wall(clock_rate)  # on the clock the controller reads (the wall's)
        # the safety net foresees crashes from the twin's activations where the twin is the worker's GPU
        self.rules = RuleSettings(control=settings, knobs=knobs, activations=self._activations,
                                  constants=self.constants)  # fmt: skip
        # the twin is an SGLang model (its admission conservativeness among its knobs): on another engine
        # (vLLM) there is no plan, no launch forecast and no activations; its rules keep a preemption cap
        self._twin_models_engine = KnobName.CONSERVATIVENESS in knobs
        self._activations_seen: dict[tuple[tuple[str, str], ...], Activations | None] = {}
        self.journal = journal
        self.engine = engine
        self.surroundings = surroundings
        self.actor = actor
        self._hold = hold  # send a worker nothing more until it starts again (the pool's hold)
        self._declare_down = declare_down  # tell the pool a dead worker stays down, or loops
        self.clock = clock
        self._workers: dict[WorkerId, _Worker] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.canary: Canary | None = None  # a plan tried on one worker of several
        self._promote: list[WorkerId] = []  # workers still to take the promoted canary's args, in order
        self._checks: list[OutcomeJob] = []  # acted plans whose window is in, to check off the loop

    def set_clock_rate(self, rate: float) -> None:
        """A worker said how fast its clock runs (an external simulated worker's server info): the
        constants are converted again, and the windows' spans with them."""
        if rate <= 0 or rate == self.clock_rate:
            return
        _log.info("controller: the workers' clock runs at %g x the wall's; constants converted", rate)
        self.clock_rate = rate
        self.constants = self._engine_constants.in_wall(rate)
        self.rules = replace(self.rules, constants=self.constants)
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

        decisions = before_launch(worker_id, args, forecast, self.rules, now)
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
        self.journal.record(decision, mode=self.mode, status=Status.APPLIED,
                            detail="the fast tier: no restart, it applies to the next request")  # fmt: skip

    # -- observation ------------------------------------------------------------------------------

    def track(self, info: WorkerInfo) -> None:
        """Follow a worker (idempotent); called for every state change the pool announces."""
        now = self.clock()
        w = self._workers.get(info.id)
        if w is None:
            reader = self.engine.log_reader() if info.managed else None
            w = self._workers[info.id] = _Worker(
                state=ControlState.initial(info.id, dict(info.args), now if info.state is WorkerState.READY else None),
                window=Window(span_s=self.constants.window_s),
                reader=reader,
                managed=info.managed,
                backlog=Backlog(memory_s=self.constants.plan_trend_s),
            )
        w.pool_state = info.state
        if info.state is WorkerState.STARTING:
            w.window = w.window.restart(now)
            w.state = w.state.without_resolved()
            w.starting_at = now
        up = info.state is WorkerState.READY or (info.state is WorkerState.DRAINING and w.held_at_start)
        if info.state is not WorkerState.STARTING:
            w.held_at_start = False
        if up and w.state.started_at is None:  # a held one is up too: the tick's rules restart it
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
        if up and w.starting_at is not None:
            w.startup_s, w.starting_at = now - w.starting_at, None
        if info.state is WorkerState.DOWN and w.managed and not w.busy and not info.stays_down:
            self._on_death(info.id, info.exit_code, info.last_error)

    def on_sample(self, worker_id: WorkerId, sample: Sample | None, error: str | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is None or sample is None:
            return
        held = self.surroundings.backlog()
        w.window = w.window.push(sample).push_proxy_queue(sample.time, held, self.surroundings.held_for_class())
        sharing = self._serving_count()
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
            # (it takes no request), and the first tick restarts it with the arguments that fit
            w.held_at_start = True
            self._hold(worker_id)
        if event.kind in (EventKind.OOM, EventKind.CRASH) and w.managed:
            # the server is going down (an OOM or a scheduler exception kills it): send it nothing more,
            # so requests are not retried against its closing port; its exit and restart lift the hold
            self._hold(worker_id)

    def _crash_foreseen(self, w: _Worker) -> bool:
        """A starting worker (not one the controller is restarting), managed, under ``auto`` with the
        planner, whose start-up line the safety net's forecast (``activations_fit``) would act on now."""
        if not (w.managed and self.mode is ControlMode.AUTO) or w.busy:
            return False  # a restart under way (busy) waits for its own worker to come up READY
        if w.pool_state is not WorkerState.STARTING:
            return False
        return evaluate(w.window, w.state, self.rules, (activations_fit,)).decision is not None

    def window(self, worker_id: WorkerId) -> Window:
        return self._workers[worker_id].window

    def backlog(self, worker_id: WorkerId) -> Backlog:
        """Work waiting for the worker without a break, as of its latest look."""
        return self._workers[worker_id].backlog

    def _serving_count(self) -> int:
        """Workers serving the pool now (the proxy's queue is shared among them): at least 1."""
        return max(1, sum(1 for w in self._workers.values() if w.pool_state is WorkerState.READY))

    def state(self, worker_id: WorkerId) -> ControlState:
        return self._workers[worker_id].state

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
        others_down = any(w.managed and (w.busy or w.state.started_at is None) for w in self._workers.values())
        for w in self._workers.values():
            w.window = w.window.at(now)
        canary_act = self._canary_step(now, others_down)
        if canary_act is not None:
            acts.append(canary_act)
            others_down = True
        for w in self._workers.values():
            self._measure_outcome(w, now)
            self._check_when_answered(w, now)
            if w.busy or w.state.started_at is None:
                continue
            if w.state.last_good_args != w.state.args and now - w.state.started_at >= self.constants.good_after_s:
                w.state = w.state.mark_good()
            if self.mode is ControlMode.OFF:
                continue
            evaluation = evaluate(w.window, w.state, self.rules, SAFETY_NET_SERVING)
            for decision, why in evaluation.refused:
                self._journal_once(
                    w, decision, f"refused:{decision.rule}:{why.split(':')[0]}", now, status=Status.REFUSED, detail=why
                )
            chosen = evaluation.decision
            if chosen is None:
                continue
            if chosen.action is Action.NOTE:
                self._journal_once(
                    w, chosen, f"note:{chosen.rule}", now, status=Status.NOTED, span=self.constants.window_s
                )
                continue
            if self.mode is ControlMode.ADVISE or not w.managed:
                why = "" if self.mode is ControlMode.ADVISE else "worker is not managed by this proxy"
                self._journal_once(w, chosen, f"advise:{chosen.rule}", now, status=Status.ADVISED, detail=why)
                continue
            if others_down and len(self._workers) > 1:
                self._journal_once(w, chosen, f"wait:{chosen.rule}", now, status=Status.REFUSED,
                                   detail="another worker is restarting or down: one at a time")  # fmt: skip
                continue
            entry_id = self.journal.record(chosen, mode=self.mode, status=Status.ACTING, before=w.window.summary())
            w.busy = True
            others_down = True
            acts.append(Act(decision=chosen, entry_id=entry_id))
        return acts

    # -- the planner (synchronous halves; the replays run off the loop in between) ----------------

    def plans_due(self, limit: int | None = None) -> list[PlanJob]:
        """Workers due a plan (at most ``limit``, the longest since its last plan first: one plan at a time,
        a fleet's first workers would otherwise be due again before its last one's turn; a worker whose
        paying restart waited for another worker's goes first, due as soon as the fleet is whole): serving,
        managed (or advised), enough evidence, outside the cool-down and the restart budget; each with
        what its plan reads."""
        if self.mode is ControlMode.OFF or not self._twin_models_engine:
            return []
        now = self.clock()
        c = self.constants
        jobs = []
        # in the fleet scenario w3's held-back look waited behind two merely due, ~50 modelled s
        for wid, w in sorted(self._workers.items(), key=lambda item: (not item[1].looks.held_back, item[1].last_plan)):
            if w.busy or w.planning or w.state.started_at is None:
                continue
            if now - w.last_plan < c.plan_interval_s and not (w.looks.held_back and self._restart_under_way(w) is None):
                continue
            if w.window.observed_s < c.min_evidence_s:
                continue
            if w.state.last_restart is not None and now - w.state.last_restart < c.cooldown_s:
                continue
            if w.pending_outcome is not None:  # the last restart's outcome is not in yet
                continue
            if w.state.restarts_within(now) >= self.settings.restarts_per_hour:
                continue
            workload = tuple(self.surroundings.recent_requests(wid))
            if not workload:
                continue
            w.last_plan = now
            open_now = tuple(self.surroundings.in_flight(wid))
            horizon = expected_horizon(w.backlog, now, answer_rate(workload, c.plan_requests),
                                       configured_s=c.plan_horizon_s, longest_s=c.plan_horizon_max_s)  # fmt: skip
            inputs = self._plan_inputs(w, workload, open_now, now, horizon)
            jobs.append(PlanJob(wid, now, inputs, w.window.throughput, horizon))
            if limit is not None and len(jobs) >= limit:
                break
        return jobs

    def _plan_inputs(
        self,
        w: _Worker,
        workload: tuple[Observed, ...],
        in_flight: tuple[InFlight, ...],
        now: float,
        horizon: Horizon,
    ) -> PlanInputs:
        c = self.constants
        args = dict(w.state.args)
        twin = self._twin(args)
        gpu, model = twin.gpu, twin.model
        decode = []
        for e in w.window.of_kind(EventKind.BATCH_STATS):
            f = e.fields
            running, used, tp = f.get("running"), f.get("used_tokens"), f.get("gen_throughput")
            if f.get("phase") == "decode" and isinstance(running, int) and isinstance(tp, (int, float)):
                used_tokens = int(used) if isinstance(used, (int, float)) else 0
                decode.append(DecodeStats(running=running, used_tokens=used_tokens, gen_throughput=float(tp),
                                          cuda_graph=bool(f.get("graph", True)), at=e.time))  # fmt: skip
        capacity = w.window.kv_capacity_tokens
        startup = w.window.startup
        if capacity is None and startup is not None and isinstance(startup.fields.get("max_total_tokens"), int):
            capacity = int(startup.fields["max_total_tokens"])
        # what a restart takes back: the batch the worker has been running (its window's mean), each request
        # half way through an answer of the recent length, its prompt prefilled again (the twin prices that)
        # and its output decoded again, or, where it keeps what it wrote, prefilled with the prompt
        running = w.window.mean_running or w.window.peak_running or 0
        written = sum(o.output_tokens / 2 for o in workload) / len(workload)
        prompts = sum(o.prompt_tokens for o in workload) / len(workload)
        # what the requests open now keep of their output when taken back (a whole answer the engine ends
        # early and gives: prefilled again as prompt, not decoded again)
        kept = sum(1 for r in in_flight if r.keeps_written) / len(in_flight) if in_flight else 0.0
        cost = RestartCost(
            startup_s=w.startup_s,  # None: not seen yet (the plan uses the twin's modelled start-up)
            drain_s=w.drain_s,
            recomputed_tokens=running * written * (1.0 - kept),
            refill_prompt_tokens=running * (prompts + written * kept),
            refill_requests=round(running),
        )
        settings = PlanSettings(
            horizon_s=horizon.seconds,
            backlog=horizon.basis != "configured",  # the backlog outlasts the configured horizon
            # a throughput gain accrues only while work waits: none with nothing waiting at this look, the
            # backlog's remainder where the work it holds falls for sure
            work_waits_s=0.0 if w.backlog.since is None else horizon.draining_s,
            queued=self.surroundings.backlog() / self._serving_count(),
            max_requests=c.plan_requests,
            min_gain=c.plan_min_gain,
            conservativeness_bounds=self.rules.bounds(KnobName.CONSERVATIVENESS),
            memory_fraction_step=c.memory_fraction_step,
            memory_fraction_bounds=self.rules.bounds(KnobName.MEMORY_FRACTION),
            min_available_gb=c.available_mem_band_gb[0],
            max_available_gb=c.available_mem_band_gb[1],
        )
        return PlanInputs(gpu=gpu, model=model, args=args, resolved=dict(w.state.resolved), decode=tuple(decode),
                          kv_capacity_tokens=capacity, workload=workload, cost=cost, settings=settings,
                          in_flight=in_flight, now=now, looks=w.looks)  # fmt: skip

    def _restart_under_way(self, w: _Worker) -> tuple[str, str] | None:
        """What keeps ``w`` from restarting now (one restart at a time, a canary judged against the others):
        its journal key and words, or None."""
        if any(o.managed and (o.busy or o.state.started_at is None) for o in self._workers.values() if o is not w):
            return "planner", "another worker is restarting or down: one at a time"
        where = self._canary_under_way()
        if len(self._managed()) >= 2 and where is not None:
            return "canary", f"a canary is under way on {where}"
        return None

    def _canary_under_way(self) -> str | None:
        """Where a canary is being judged or its promotion rolled out (the fleet), or None."""
        if self.canary is not None:
            return self.canary.worker_id
        return "the fleet" if self._promote else None

    def _managed(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.managed]

    def _share(self, w: _Worker, since: float = float("-inf")) -> float | None:
        """``w``'s output tokens/s over the window (from ``since`` on), as decoded, against the other serving
        managed workers' mean over the same time: those that had served a whole window before it began,
        where any did (one ready since is still refilling its batch and would flatter ``w``: in the fleet
        scenario a canary's share read 0.97 before its restart against a worker just reverted from an
        operator's bad trial, 0.64 in the arm without the trial, and the canary was promoted on it)."""
        serving = [o for o in self._managed() if o is not w and not o.busy and o.state.started_at is not None]
        begins = max(since, self.clock() - self.constants.window_s)
        settled = [o for o in serving if o.window.since <= begins - self.constants.window_s]  # serving since
        others = [o.window.after(since).decode_rate for o in (settled or serving)]
        value = share(w.window.after(since).decode_rate, others)
        return None if value is None else round(value, 4)

    def _canary_step(self, now: float, others_down: bool) -> Act | None:
        """Judge a canary whose window is in, or roll its promotion on by one worker."""
        if self.mode is not ControlMode.AUTO:
            return None
        if self._promote and not others_down:
            wid = self._promote.pop(0)
            w = self._workers.get(wid)
            canary = self.canary
            if w is None or canary is None or w.busy or w.state.started_at is None:
                return None
            changed = {k: v for k, v in canary.new_args.items() if canary.old_args.get(k) != v}
            new_args = {**w.state.args, **changed}
            if not self._promote:
                self.canary = None
            if new_args == dict(w.state.args):
                return None
            decision = Decision(worker_id=wid, rule="canary_promote", time=now, old_args=dict(w.state.args),
                                new_args=new_args, kind=RuleKind.TUNING,
                                reason=f"the canary {canary.worker_id} beat the others with {changed}: rolled out here")  # fmt: skip
            entry_id = self.journal.record(decision, mode=self.mode, status=Status.ACTING, before=w.window.summary(),
                                           extra={"canary": canary.worker_id})  # fmt: skip
            w.busy = True
            return Act(decision=decision, entry_id=entry_id)
        canary = self.canary
        if canary is None or canary.opens is None or self._promote:
            return None
        w = self._workers.get(canary.worker_id)
        if w is None:
            self.canary = None
            return None
        opens = canary.opens
        if w.busy or others_down or now < opens or w.window.after(opens).observed_s < self.constants.min_evidence_s:
            return None  # judged against the others only while they all serve, once it has refilled
        after = self._share(w, since=opens)
        early = now < opens + self.constants.window_s  # the whole window is not in yet
        if early and not failing(after, canary.before, self.constants.canary_fail_below):
            return None
        verdict_ = judge(after, canary.before, self.constants.canary_margin, canary.promote_above)
        if verdict_ is CanaryVerdict.WAIT:
            return None
        figures: dict[str, object] = {
            "canary_share_before": canary.before,
            "canary_share_after": round(after or 0.0, 4),
        }
        if canary.promote_above is not None:
            figures["canary_promotion_pays_above"] = round(canary.promote_above, 4)
        if early:
            figures["canary_failed_early_s"] = round(w.window.after(opens).observed_s, 1)  # before window_s was in
        self.journal.update(canary.entry_id, fields={"canary_verdict": str(verdict_), **figures})
        if verdict_ is CanaryVerdict.PROMOTE:
            self._promote = [o.state.worker_id for o in self._managed() if o is not w]
            return None
        self.canary = None
        if verdict_ is CanaryVerdict.KEEP:
            return None
        before = "not measured" if canary.before is None else f"{canary.before:.3f}"
        decision = Decision(worker_id=w.state.worker_id, rule="canary_revert", time=now, old_args=dict(w.state.args),
                            new_args=dict(canary.old_args), kind=RuleKind.CORRECTIVE,
                            reason=f"the canary served {after or 0.0:.3f} x the others' mean "
                                   f"throughput (before its restart: {before}): its old args back")  # fmt: skip
        entry_id = self.journal.record(decision, mode=self.mode, status=Status.ACTING, before=w.window.summary(),
                                       extra={"canary": w.state.worker_id, **figures})  # fmt: skip
        w.busy = True
        return Act(decision=decision, entry_id=entry_id)

    def plan_now(self, job: PlanJob) -> Act | None:
        """Compute ``job`` here (tests, and callers without a loop) and decide on it."""
        return self.decide_plan(job, run_plan(job.inputs))

    def decide_plan(self, job: PlanJob, plan: Plan) -> Act | None:
        """Turn a plan into an act (``auto``, managed, it pays), a journal entry, or nothing."""
        w = self._workers.get(job.worker_id)
        if w is None:
            return None
        w.planning = False
        now = self.clock()
        if w.busy or w.state.started_at is None:
            return None
        if w.state.started_at > job.time or dict(w.state.args) != dict(job.inputs.args):
            return None  # the worker restarted while its plan was computed: the plan is of what it was
        old, new = dict(w.state.args), dict(plan.best.args)
        decision = Decision(worker_id=job.worker_id, rule="planner", reason=_plan_reason(job, plan), time=now,
                            evidence=_planned(job, plan), old_args=old, new_args=new, kind=RuleKind.TUNING,
                            change=self._knob_change(w, old, new))  # fmt: skip
        w.looks = w.looks.after(plan)
        if not plan.worth or w.looks.paying < self.constants.plan_confirmations:
            self._note_plan(w, plan, decision, now)
            return None
        return self._restart_for_plan(w, job, plan, decision, now)

    def _knob_change(self, w: _Worker, old: dict[str, object], new: dict[str, object]) -> KnobChange | None:
        """The knob a plan moves, where it moves exactly one argument, a knob's, to a number (else None)."""
        moved = [k for k in new if old.get(k) != new.get(k)]
        if len(moved) != 1:
            return None
        arg = moved[0]
        knob = next((k for k, spec in self.rules.knobs.items() if spec.arg == arg), None)
        before, after = old.get(arg), new[arg]
        if knob is None or not isinstance(after, (int, float)):
            return None
        prior = before if isinstance(before, (int, float)) else w.state.resolved.get(arg)
        direction = 1 if prior is None or after > prior else -1
        return KnobChange(knob=str(knob), arg=arg, old=prior, new=float(after), direction=direction)

    def _note_plan(self, w: _Worker, plan: Plan, decision: Decision, now: float) -> None:
        """Journal the twin's view of a plan that does not restart the worker: one that pays on too few
        plans yet (one look across the line among many is chance, not a trend), or one that does not pay
        (noted once per cool-down, with how well the twin predicts the worker now)."""
        note = replace(decision, action=Action.NOTE, new_args=decision.old_args, change=None)  # no restart
        confirm = self.constants.plan_confirmations
        if plan.worth:
            self.journal.record(note, mode=self.mode, status=Status.NOTED, before=w.window.summary(),
                                detail=f"pays on {w.looks.paying} plan(s) of the {confirm} a restart needs, none saying no since",
                                extra={"predicted_gain": round(plan.predicted_gain, 4)})  # fmt: skip
            return
        error = plan.current_error  # the twin on the requests it replayed, against what they got
        accuracy = {"current_prediction_error": round(error, 4)} if error is not None else {}
        key = "note:planner"
        last = w.state.noted.get(key)
        if last is None or now - last >= max(self.constants.cooldown_s, self.constants.plan_interval_s):
            w.state = w.state.note(key, now)
            self.journal.record(note, mode=self.mode, status=Status.NOTED, detail=plan.reason,
                                before=w.window.summary(),
                                extra={"predicted_gain": round(plan.predicted_gain, 4), **accuracy})  # fmt: skip

    def _restart_for_plan(self, w: _Worker, job: PlanJob, plan: Plan, decision: Decision, now: float) -> Act | None:
        """A plan that pays, confirmed: refused by the rules' gate, advised, held back while another restart
        or a canary is under way, or acted on (a canary beside two or more managed workers)."""
        old, new = decision.old_args, decision.new_args  # the plan's own dicts, as decided
        base = plan.current.output_tok_per_s  # the work in flight computed again at the current pace
        # the work taken back: its prompts and what it kept prefilled again, what it lost decoded again
        settle = plan.refill_s + (job.inputs.cost.recomputed_tokens / base if base > 0 else 0.0)
        extra = {
            "predicted_gain": round(plan.predicted_gain, 4),
            "predicted_throughput": decision.evidence_json()["predicted_throughput"],
            "outcome_settle_s": round(settle, 1),
        }
        why = gate(decision, w.state, self.rules, now)
        if why is not None and not why.startswith("flip guard"):  # the economics replace the flip guard
            self._journal_once(w, decision, f"refused:planner:{why.split(':')[0]}", now, status=Status.REFUSED,
                               detail=why)  # fmt: skip
            return None
        if self.mode is ControlMode.ADVISE or not w.managed:
            detail = "" if self.mode is ControlMode.ADVISE else "worker is not managed by this proxy"
            self.journal.record(decision, mode=self.mode, status=Status.ADVISED, detail=detail,
                                before=w.window.summary(), extra=extra)  # fmt: skip
            return None
        waiting_for = self._restart_under_way(w)
        if waiting_for is not None:  # due again as soon as the fleet is whole (plans_due)
            w.looks = replace(w.looks, held_back=True)
            self._journal_once(w, decision, f"wait:{waiting_for[0]}", now, status=Status.REFUSED,
                               detail=waiting_for[1])  # fmt: skip
            return None
        fleet = len(self._managed()) >= 2
        entry_id = self.journal.record(decision, mode=self.mode, status=Status.ACTING, before=w.window.summary(),
                                       extra={**extra, "canary": job.worker_id} if fleet else extra)  # fmt: skip
        if fleet:
            self.canary = Canary(worker_id=job.worker_id, entry_id=entry_id, old_args=old, new_args=new,
                                 before=self._share(w), promote_above=pays_above(
                                     plan.cost_tokens, base, plan.accrues_s))  # fmt: skip
        w.busy = True
        return Act(decision=decision, entry_id=entry_id, settle_s=settle,
                   expectation=Expectation(plan.twin, new, plan.basis, old_args=old))  # fmt: skip

    def trial(self, worker_id: WorkerId, args: Mapping[str, object], *, note: str = "") -> Act:
        """An operator's trial: ``args`` (merged over the worker's own) tried on ``worker_id`` as a
        canary, journalled like a plan (reason "operator trial") and judged, promoted, kept or
        reverted by the same canary code. Returns the act to carry out (the caller starts it);
        raises :class:`TrialRefused` (in words) when it cannot start now."""
        now = self.clock()
        w = self._workers.get(worker_id)
        if w is None:
            raise TrialRefused(f"no worker {worker_id!r} in this pool", code="unknown_worker")
        if self.mode is not ControlMode.AUTO:
            raise TrialRefused(f"control mode is {self.mode}: a trial restarts a worker, only in auto")
        if not w.managed:
            raise TrialRefused(f"worker {worker_id} is not managed by this proxy: it cannot be restarted")
        if len(self._managed()) < 2:
            raise TrialRefused("a trial needs two or more managed workers: the canary is judged against the others")
        under_way = self._canary_under_way()
        if under_way is not None:
            raise TrialRefused(f"a canary is under way on {under_way}: one at a time")
        busy = [
            wid
            for wid, o in self._workers.items()
            if o.managed and (o.busy or o.state.started_at is None or o.pool_state is not WorkerState.READY)
        ]
        if busy:
            raise TrialRefused(f"{', '.join(busy)} restarting or down: one at a time")
        old = dict(w.state.args)
        new = {**old, **args}
        if new == old:
            raise TrialRefused(f"worker {worker_id} already runs {dict(args)}", code="no_change")
        moved = {k: v for k, v in new.items() if old.get(k) != v}
        reason = "operator trial" + (f": {note}" if note else "") + f" of {moved}"
        decision = Decision(worker_id=worker_id, rule="operator_trial", reason=reason, time=now, old_args=old,
                            new_args=new, kind=RuleKind.TUNING)  # fmt: skip
        entry_id = self.journal.record(decision, mode=self.mode, status=Status.ACTING, before=w.window.summary(),
                                       extra={"canary": worker_id})  # fmt: skip
        self.canary = Canary(worker_id=worker_id, entry_id=entry_id, old_args=old, new_args=new,
                             before=self._share(w))  # fmt: skip
        w.busy = True
        return Act(decision=decision, entry_id=entry_id)

    def start_trial(self, worker_id: WorkerId, args: Mapping[str, object], *, note: str = "") -> int:
        """:meth:`trial`, carried out in the background (the proxy's admin endpoint); returns its journal id."""
        act = self.trial(worker_id, args, note=note)
        self._spawn(self.carry_out(act))
        return act.entry_id

    def decide_revival(
        self, worker_id: WorkerId, exit_code: int | None = None, last_error: str | None = None
    ) -> Act | None:
        """A managed worker died (``exit_code``: its process's, negative for a signal, where known;
        ``last_error``: the pool's words for it, how it ended and what it said last): classify,
        count, and choose the args it comes back with. A crash loop the ``crash_loop`` rule cannot
        break (it would go back to the args the worker runs) is journaled once per loop.

        Returns the revival to carry out (``auto``, or ``advise`` with the args it died with; both
        with ``revive``), else None: ``revive = false`` journals what it would do, ``off`` only
        records the death.
        """
        now = self.clock()
        w = self._workers[worker_id]
        if w.reader is not None:
            for event in w.reader.flush(now):
                w.window = w.window.push(event)
        cause = self._death_cause(worker_id, w, now, exit_code, last_error)
        w.state = w.state.after_death(now)
        if self.mode is ControlMode.OFF:
            _log.warning(
                "worker %s died (%s): it stays down (control.mode = off restarts nothing; advise or auto revive it)",
                worker_id,
                cause,
            )
            return None
        delay = revive_delay(w.state, self.constants, now)
        deaths = w.state.deaths_within(now, self.constants.crash_loop_window_s)
        if deaths <= 1:  # the loop it was in, if any, is over: the death before left the window
            w.state = w.state.with_crash_loop_noted(False)
        chosen = evaluate(w.window.at(now), w.state, self.rules, ON_DEATH).decision
        if chosen is not None:
            decision = Decision(
                worker_id=chosen.worker_id, rule=chosen.rule, reason=f"worker died ({cause}); {chosen.reason}", time=now,
                evidence=Death(rule=chosen.evidence, death=cause, deaths_in_window=deaths),
                old_args=chosen.old_args, new_args=chosen.new_args, kind=chosen.kind, change=chosen.change,
                delay_s=max(delay, chosen.delay_s),
            )  # fmt: skip
        else:
            decision = self._revival(worker_id, w, cause, deaths, now, delay)
        advice = None
        if not self.settings.revive:
            advice = "the worker stays down (revive = false)"
        elif self.mode is ControlMode.ADVISE and dict(decision.new_args) != dict(w.state.args):
            # advise changes no argument, but a dead worker is no advice: it comes back as it was,
            # and what a rule would change is journaled beside it
            advice = "advice (mode advise): the worker comes back with its own arguments"
        if advice is not None:
            self.journal.record(
                decision, mode=self.mode, status=Status.ADVISED, detail=advice, before=w.window.summary()
            )
            if not self.settings.revive:
                return None
            decision = self._revival(worker_id, w, cause, deaths, now, decision.delay_s)
        # a loop on the same arguments only: a rule changing them (an OOM's) is no loop yet
        loop = crash_loop_unbroken(w.state, self.constants, now, cause) if decision.rule == "revive" else None
        if loop is not None:
            _log.warning("worker %s: %s", worker_id, loop.reason)
            w.state = w.state.with_crash_loop_noted(True)
            self.journal.record(loop, mode=self.mode, status=Status.NOTED, before=w.window.summary())
        back_in = decision.delay_s
        _log.warning(
            "worker %s died (%s, death %d in %g s): %s %s",
            worker_id,
            cause,
            deaths,
            self.constants.crash_loop_window_s,
            "restarting it" if decision.rule == "revive" else f"{decision.rule}: restarting it",
            f"in {back_in:g} s (crash back-off)" if back_in > 0 else "now",
        )
        entry_id = self.journal.record(
            decision,
            mode=self.mode,
            status=Status.ACTING,
            before=w.window.summary(),
            detail=f"back in {back_in:g} s (crash back-off), then the start-up" if back_in > 0 else "",
        )
        w.busy = True
        return Act(decision=decision, entry_id=entry_id, revival=True)

    @staticmethod
    def _revival(worker_id: WorkerId, w: _Worker, cause: str, deaths: int, now: float, delay_s: float) -> Decision:
        """The worker back with the arguments it died with, after ``delay_s``."""
        return Decision(
            worker_id=worker_id, rule="revive", reason=f"worker died ({cause}); restarting it with the same args",
            time=now, evidence=Death(death=cause, deaths_in_window=deaths),
            old_args=w.state.args, new_args=w.state.args, kind=RuleKind.SAFETY, delay_s=delay_s,
        )  # fmt: skip

    def _death_cause(
        self, worker_id: WorkerId, w: _Worker, now: float, exit_code: int | None = None, last_error: str | None = None
    ) -> str:
        """In words, from the window's events; the log tail is read when the follower saw nothing;
        then the pool's words (how the process ended and what it said last), or how it ended."""
        oom, crash = w.window.last(EventKind.OOM), w.window.last(EventKind.CRASH)
        if oom is not None:
            return f"out of memory in {oom.fields.get('phase', 'unknown')}"
        if crash is not None:
            return f"crash: {crash.fields.get('exception') or crash.line.splitlines()[0][:160]}"
        death = self.engine.classify_death(self.surroundings.log_tail(worker_id, _TAIL_LINES))
        if death is None or death.cause == "unknown":
            if last_error:
                return shorten_cause(last_error, _DEATH_CHARS)
            return "exited" if exit_code is None else how_it_ended(exit_code)
        if death.cause == "oom":
            w.window = w.window.push(
                LogEvent(
                    kind=EventKind.OOM, time=now, fields={"phase": death.phase, "cause": "log_tail"}, line=death.detail
                )
            )
            return f"out of memory in {death.phase}"
        return f"{death.cause}: {death.detail}"[:200]

    def _measure_outcome(self, w: _Worker, now: float) -> None:
        if w.pending_outcome is None or w.busy:
            return
        pending = w.pending_outcome
        if now < pending.due or w.window.observed_s < self.constants.min_evidence_s:
            return
        w.pending_outcome = None
        entry = self.journal.get(pending.entry_id)
        after = w.window.summary()
        before = (entry or {}).get("outcome", {}) or {}
        fields: dict[str, float] | None = None
        tb, ta = (before.get("before") or {}).get("throughput"), after.get("throughput")
        if pending.expectation is not None and isinstance(ta, (int, float)) and ta > 0:
            # the first window after the restart: the gain stands until the check's, over a few hundred
            # answers each side, replaces it (:meth:`record_outcome`; a restart's first minute refills
            # what it took back, on a start-up's admission)
            fields = {"first_window_throughput": ta}
            if isinstance(tb, (int, float)) and tb > 0:
                fields["first_window_gain"] = round(ta / tb - 1.0, 4)
            if "gain_requests" not in (entry or {}):  # the check's figures, if they came first, stay
                fields["measured_throughput"] = ta
                if "first_window_gain" in fields:
                    fields["measured_gain"] = fields["first_window_gain"]
        self.journal.update(
            pending.entry_id,
            outcome={"after": after, "verdict": verdict(before.get("before") or {}, after)},
            fields=fields,
        )
        if pending.expectation is not None:
            until = pending.opens + CHECK_AFTER_WINDOWS * self.constants.window_s
            w.pending_check = PendingCheck(pending.entry_id, pending.expectation, pending.opens, until, pending.ready)

    def _check_when_answered(self, w: _Worker, now: float) -> None:
        """Queue the check of the worker's last acted plan (:class:`PendingCheck`) once it has answered
        ``plan_requests`` requests under its args, once it stops serving under them (it restarts or
        died: on what it answered until then), or at the check's latest."""
        pending = w.pending_check
        if pending is None:
            return
        wid = w.state.worker_id
        workload = tuple(self.surroundings.recent_requests(wid))
        over = w.busy or w.state.started_at is None or now >= pending.until
        if not over:
            answered = sum(1 for o in workload if o.arrived >= pending.since and o.finished is not None)
            if answered < self.constants.plan_requests:
                return
        w.pending_check = None
        inputs = OutcomeInputs(expectation=pending.expectation, workload=workload, since=pending.since,
                               in_flight=tuple(self.surroundings.in_flight(wid)), now=now,
                               max_requests=self.constants.plan_requests, ready=pending.ready)  # fmt: skip
        self._checks.append(OutcomeJob(wid, pending.entry_id, inputs))

    def outcomes_due(self, limit: int | None = None) -> list[OutcomeJob]:
        """Acted plans whose check is due (:meth:`_check_when_answered`; at most ``limit``, the oldest
        first), each with the requests it is checked on (taken once)."""
        taken = len(self._checks) if limit is None else limit
        jobs, self._checks = self._checks[:taken], self._checks[taken:]
        return jobs

    def record_outcome(self, job: OutcomeJob, outcome: Outcome) -> None:
        """Journal how the plan's twin did on the requests served under its args: ``prediction_error``
        on the plan's basis (none when too few requests were answered in the window)."""
        fields: dict[str, object] = {"prediction_basis": outcome.basis, "outcome_requests": outcome.requests}
        if outcome.error is not None and outcome.predicted is not None and outcome.measured is not None:
            fields |= {"predicted_outcome": round(outcome.predicted, 3), "measured_outcome": round(outcome.measured, 3),
                       "prediction_error": round(outcome.error, 4)}  # fmt: skip
        if outcome.basis != "waiting" and outcome.answer_error is not None:  # what the throughput cannot see
            fields |= {"answer_error": round(outcome.answer_error, 4)}
        if outcome.gain is not None and outcome.throughput is not None:  # over the same answers, like with like
            fields |= {"measured_gain": round(outcome.gain, 4), "measured_throughput": round(outcome.throughput, 1),
                       "gain_requests": outcome.requests}  # fmt: skip
        self.journal.update(job.entry_id, fields=fields)

    def _journal_once(
        self,
        w: _Worker,
        decision: Decision,
        key: str,
        now: float,
        *,
        status: Status,
        detail: str = "",
        span: float | None = None,
    ) -> None:
        """Journal a decision that is not acted on, once per ``span`` (default: the cool-down)."""
        span = self.constants.cooldown_s if span is None else span
        last = w.state.noted.get(key)
        if last is not None and now - last < max(span, self.constants.interval_s):
            return
        w.state = w.state.note(key, now)
        self.journal.record(decision, mode=self.mode, status=status, detail=detail, before=w.window.summary())

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
        time, beside the plan, each journaled on the first tick after it is in."""
        computing: tuple[PlanJob, asyncio.Future[Plan]] | None = None
        checking: tuple[OutcomeJob, asyncio.Future[Outcome]] | None = None
        try:
            while True:
                for act in self.tick():
                    await self.carry_out(act)
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
                        self._workers[job.worker_id].planning = True
                        computing = (job, asyncio.ensure_future(self._offload(run_plan, job.inputs)))
                await asyncio.sleep(self.constants.interval_s)
        finally:
            for running in (computing, checking):
                if running is not None:
                    running[1].cancel()  # what it computes is dropped (its process or thread ends it by itself)
            await self.close()

    def _decide_computed(self, job: PlanJob, computed: asyncio.Future[Plan]) -> Act | None:
        """Decide on a plan computed off the loop (a failed one is logged, its worker free to plan again)."""
        try:
            plan = computed.result()
        except Exception as exc:
            w = self._workers.get(job.worker_id)
            if w is not None:
                w.planning = False
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
            w.busy = False
            if self.canary is not None and self.canary.entry_id == act.entry_id:
                self.canary = None  # refused before the worker stopped: nothing to judge
            return
        now = self.clock()
        info = result.info
        if result.drain is not None:
            w.drain_s = result.drain.drain_s
        w.state = w.state.after_restart(d, now, self.constants.flip_guard_s)
        w.busy = False
        w.looks = Looks()  # whatever restarted it, its plans are read afresh on its new arguments
        details = result.drain.to_json() if result.drain is not None else None
        if info.state is WorkerState.READY:
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
            status = Status.REVIVED if act.revival and d.rule == "revive" else Status.APPLIED
            self.journal.update(
                act.entry_id, status=status, detail=f"{d.worker_id} ready (pid {info.pid})", act=details
            )
            opens = now + act.settle_s
            w.pending_outcome = PendingOutcome(act.entry_id, opens, opens + self.constants.window_s, act.expectation,
                                               ready=now)  # fmt: skip
            if self.canary is not None and self.canary.entry_id == act.entry_id:
                self.canary = replace(self.canary, opens=opens)
        else:
            detail = f"{d.worker_id} is {info.state}: " + shorten_cause(info.last_error or "", _DETAIL_CHARS)
            self.journal.update(act.entry_id, status=Status.FAILED, detail=detail, act=details)
            if self.canary is not None and self.canary.entry_id == act.entry_id:
                self.canary = None  # the canary did not come back: its death's rules take over
            if info.state is WorkerState.DOWN:
                self._on_death(d.worker_id, info.exit_code, info.last_error)
