"""The planner's synchronous halves: which workers are due a plan, what it reads, what comes of it.

:meth:`Planning.due` picks the serving workers due a look and gathers what the plan reads (the
worker's recent requests, its batch statistics, what a restart would cost it, the horizon the
traffic says a gain accrues over); the replays (:func:`~proxy.control.planner.run_plan`) run off the
loop; :meth:`Planning.decide` turns the plan into a note, a refusal, advice, a wait for another
worker's restart, or a restart (a canary beside two or more managed workers, through
:class:`~proxy.control.trials.Trials`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from proxy.control.canary import pays_above
from proxy.control.decision import Action, Decision, KnobChange, RuleKind
from proxy.control.economics import replayed_requests
from proxy.control.evidence import Evidence, HeldAtGraphs, Planned, QueueSide
from proxy.control.horizon import Horizon, answer_rate, expected_horizon
from proxy.control.journal import Status
from proxy.control.peers import PeerCandidate, PeerLoad, peer_candidate
from proxy.control.phase import Phase, Tracked
from proxy.control.planner import (
    DecodeStats,
    Expectation,
    InFlight,
    Observed,
    Plan,
    PlanInputs,
    PlanSettings,
    Prediction,
    RestartCost,
    Twin,
)
from proxy.control.ports import Act, PlanJob, Surroundings
from proxy.control.roster import Roster
from proxy.control.rules import gate, worker_activations
from proxy.control.trials import Trials
from proxy.control.window import Window
from proxy.engines.base import EventKind, KnobName
from proxy.policy import ControlMode

__all__ = ["Planning", "decode_stats", "kv_capacity", "plan_reason", "planned"]


def plan_reason(job: PlanJob, plan: Plan) -> str:
    """The plan's reason, with its horizon in words where the traffic said something about it."""
    horizon = job.horizon
    told = horizon.basis != "configured" or 0 < plan.accrues_s < horizon.seconds  # the traffic said something
    return f"{plan.reason}; {horizon.describe()}" if told else plan.reason


def planned(job: PlanJob, plan: Plan) -> Planned:
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
        peers_rate=None if plan.peer is None else round(plan.peer.peers_rate, 2),
        busy=None if plan.peer is None else round(plan.peer.own_busy, 3),
        queue_past_over_at=None if plan.queue is None else _ratio(plan.queue.past_limit, plan.queue.at_limit),
        held_over_current=None if plan.hold is None else _ratio(plan.hold.held, plan.hold.against or plan.current),
    )  # fmt: skip


def _ratio(a: Prediction, b: Prediction) -> float | None:
    """``a``'s output rate over ``b``'s (None: ``b`` wrote nothing)."""
    return round(a.output_tok_per_s / b.output_tok_per_s, 4) if b.output_tok_per_s > 0 else None


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def decode_stats(window: Window) -> tuple[DecodeStats, ...]:
    """The worker's decode statistics in its window, as the twin's calibration reads them."""
    decode = []
    for e in window.of_kind(EventKind.BATCH_STATS):
        f = e.fields
        running, used, tp = f.get("running"), f.get("used_tokens"), f.get("gen_throughput")
        if f.get("phase") == "decode" and isinstance(running, int) and isinstance(tp, (int, float)):
            used_tokens = int(used) if isinstance(used, (int, float)) else 0
            decode.append(DecodeStats(running=running, used_tokens=used_tokens, gen_throughput=float(tp),
                                      cuda_graph=bool(f.get("graph", True)), at=e.time))  # fmt: skip
    return tuple(decode)


def kv_capacity(window: Window) -> int | None:
    """The worker's KV pool in tokens, as it last reported it (its start-up line where nothing since)."""
    capacity = window.kv_capacity_tokens
    startup = window.startup
    if capacity is None and startup is not None and isinstance(startup.fields.get("max_total_tokens"), int):
        capacity = int(startup.fields["max_total_tokens"])
    return capacity


class Planning:
    """Plans for the roster's workers; ``twin`` gives the twin's presets for a worker's args, and
    ``twin_models_engine`` says whether the twin models this engine at all (no plan where not)."""

    def __init__(
        self,
        roster: Roster,
        surroundings: Surroundings,
        trials: Trials,
        twin: Callable[[Mapping[str, object]], Twin],
        *,
        twin_models_engine: bool,
    ) -> None:
        self._roster = roster
        self._surroundings = surroundings
        self._trials = trials
        self._twin = twin
        self._twin_models_engine = twin_models_engine

    def due(self, limit: int | None = None) -> list[PlanJob]:
        """Workers due a plan (at most ``limit``, the longest since its last plan first: one plan at a time,
        a fleet's first workers would otherwise be due again before its last one's turn; a worker whose
        paying restart waited for another worker's goes first, due as soon as the fleet is whole): serving,
        managed (or advised), enough evidence, outside the cool-down and the restart budget; each with
        what its plan reads."""
        roster, c = self._roster, self._roster.constants
        if roster.mode is ControlMode.OFF or not self._twin_models_engine:
            return []
        now = roster.clock()
        jobs = []
        # in the fleet scenario w3's held-back look waited behind two merely due, ~50 modelled s
        for wid, w in sorted(
            roster.workers.items(), key=lambda item: (item[1].looks.held_back is None, item[1].last_plan)
        ):
            if w.phase is not Phase.SERVING:  # not up, acting, or its plan being computed
                continue
            if now - w.last_plan < c.plan_interval_s and not (
                w.looks.held_back is not None and self._trials.restart_under_way(w) is None
            ):
                continue
            if w.window.observed_s < c.min_evidence_s:
                continue
            if w.state.last_restart is not None and now - w.state.last_restart < c.cooldown_s:
                continue
            if w.pending_outcome is not None:  # the last restart's outcome is not in yet
                continue
            if w.state.restarts_within(now) >= roster.settings.restarts_per_hour:
                continue
            workload = tuple(self._surroundings.recent_requests(wid))
            if not workload:
                continue
            w.last_plan = now
            open_now = tuple(self._surroundings.in_flight(wid))
            horizon = expected_horizon(w.backlog, now, answer_rate(workload, c.plan_requests),
                                       configured_s=c.plan_horizon_s, longest_s=c.plan_horizon_max_s)  # fmt: skip
            inputs = self.inputs(w, workload, open_now, now, horizon)
            jobs.append(PlanJob(wid, now, inputs, w.window.throughput, horizon))
            if limit is not None and len(jobs) >= limit:
                break
        return jobs

    def inputs(
        self,
        w: Tracked,
        workload: tuple[Observed, ...],
        in_flight: tuple[InFlight, ...],
        now: float,
        horizon: Horizon,
    ) -> PlanInputs:
        c = self._roster.constants
        args = dict(w.state.args)
        twin = self._twin(args)
        gpu, model = twin.gpu, twin.model
        decode, capacity = decode_stats(w.window), kv_capacity(w.window)
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
        queue_gate = self._surroundings.queue_gate(w.state.worker_id)
        settings = PlanSettings(
            horizon_s=horizon.seconds,
            backlog=horizon.basis != "configured",  # the backlog outlasts the configured horizon
            # a throughput gain accrues only while work waits: none with nothing waiting at this look, the
            # backlog's remainder where the work it holds falls for sure
            work_waits_s=0.0 if w.backlog.since is None else horizon.draining_s,
            queued=self._surroundings.backlog() / self._roster.serving_count(),
            max_requests=replayed_requests(c.plan_requests, w.window.peak_running),
            min_gain=c.plan_min_gain,
            conservativeness_bounds=self._roster.rules.bounds(KnobName.CONSERVATIVENESS),
            memory_fraction_step=c.memory_fraction_step,
            memory_fraction_bounds=self._roster.rules.bounds(KnobName.MEMORY_FRACTION),
            min_available_gb=c.available_mem_band_gb[0],
            activations_known=worker_activations(w.window, w.state, self._roster.rules) is not None,
            max_available_gb=c.available_mem_band_gb[1],
            engine_queue=queue_gate[0] if queue_gate is not None else None,
            gate_period_s=queue_gate[1] if queue_gate is not None else 0.0,
            prefix_first=self._surroundings.prefix_first(w.state.worker_id),
            queue_sides=self._surroundings.queue_sides(w.state.worker_id),
            prefixes_shared=self._surroundings.prefixes_shared(w.state.worker_id),
            peer=self._peer(w, twin),
        )
        return PlanInputs(gpu=gpu, model=model, args=args, resolved=dict(w.state.resolved), decode=decode,
                          kv_capacity_tokens=capacity, workload=workload, cost=cost, settings=settings,
                          in_flight=in_flight, now=now, looks=w.looks)  # fmt: skip

    def _load(self, w: Tracked) -> PeerLoad:
        twin = self._twin(dict(w.state.args))
        return PeerLoad(worker_id=w.state.worker_id, args=dict(w.state.args), hardware=(twin.gpu, twin.model),
                        rate=w.window.decode_rate,
                        busy=w.window.busy_share(self._roster.constants.low_usage))  # fmt: skip

    def _peer(self, w: Tracked, twin: Twin) -> PeerCandidate | None:
        """The arguments ``w``'s serving peers run and their measured gain over it
        (:func:`~proxy.control.peers.peer_candidate`)."""
        others = [self._load(o) for o in self._roster.workers.values() if o is not w and o.serving]
        return peer_candidate(self._load(w), others, twin.names.tuned) if others else None

    def decide(self, job: PlanJob, plan: Plan, *, reshape_pending: bool = False) -> Act | None:
        """Turn a plan into an act (``auto``, managed, it pays), a journal entry, or nothing;
        ``reshape_pending``: a reshape of the pool paid on its last look (its next look decides)."""
        w = self._roster.workers.get(job.worker_id)
        if w is None:
            return None
        w.plan_done()
        now = self._roster.clock()
        since = w.serving_since
        if since is None:
            return None
        if since > job.time or dict(w.state.args) != dict(job.inputs.args):
            return None  # the worker restarted while its plan was computed: the plan is of what it was
        old, new = dict(w.state.args), dict(plan.best.args)
        decision = Decision(worker_id=job.worker_id, rule="planner", reason=plan_reason(job, plan), time=now,
                            evidence=planned(job, plan), old_args=old, new_args=new, kind=RuleKind.TUNING,
                            change=self._knob_change(w, old, new))  # fmt: skip
        w.looks = w.looks.after(plan)
        self._hold(w, job, plan, now)
        self._queue_side(w, job, plan, now)
        if not plan.worth or w.looks.paying < self._roster.constants.plan_confirmations:
            self._note(w, plan, decision, now)
            return None
        return self._restart_for_plan(w, job, plan, decision, now, reshape_pending=reshape_pending)

    def _hold(self, w: Tracked, job: PlanJob, plan: Plan, now: float) -> None:
        """Hold the worker at its CUDA graphs' batch where the look's twin says that pays, let it go where
        it says it loses; a look inside the twin's noise, or whose replay never ran past the graphs, leaves
        it as it is (:mod:`proxy.control.hold`). No restart: no cool-down or confirmation. Only ``auto``
        holds (another mode journals what it would do). Journaled when it changes."""
        price = plan.hold
        if price is None or not (price.pays or price.loses):
            return
        most = price.at if price.pays else None
        if most == w.held_open:
            return
        auto = self._roster.mode is ControlMode.AUTO
        if auto:
            self._surroundings.hold_open(job.worker_id, most)
        w.held_open = most
        current, held = plan.current, price.held
        evidence = HeldAtGraphs(graph_batch=price.at, peak_running=current.peak_running,
                                predicted_held_throughput=round(held.output_tok_per_s, 2),
                                predicted_current=round(current.output_tok_per_s, 2),
                                held_answer_s=_rounded(held.mean_answer_s),
                                current_answer_s=_rounded(current.mean_answer_s))  # fmt: skip
        verb = f"hold at most {price.at} open, the batch its CUDA graphs cover" if most else "no hold"
        reason = (f"{verb}: the twin writes {held.output_tok_per_s:.0f} tok/s held at {price.at} open against "
                  f"{current.output_tok_per_s:.0f} running up to {current.peak_running}, answers in "
                  f"{_rounded(held.mean_answer_s)} s against {_rounded(current.mean_answer_s)} s")  # fmt: skip
        self._journal_lever(w, job, "hold_at_graphs", reason, evidence, now, "the fast tier")

    def _journal_lever(
        self, w: Tracked, job: PlanJob, rule: str, reason: str, evidence: Evidence, now: float, who: str
    ) -> None:
        """Journal a move of one of the proxy's own levers that a look priced (no restart, its args as they are)."""
        auto = self._roster.mode is ControlMode.AUTO
        args = dict(w.state.args)
        decision = Decision(worker_id=job.worker_id, rule=rule, reason=reason, time=now, evidence=evidence,
                            old_args=args, new_args=args, action=Action.NOTE, kind=RuleKind.TUNING)  # fmt: skip
        self._roster.journal.record(decision, mode=self._roster.mode,
                                    status=Status.APPLIED if auto else Status.ADVISED,
                                    detail=f"{who}: no restart, it applies to the next request")  # fmt: skip

    def _queue_side(self, w: Tracked, job: PlanJob, plan: Plan, now: float) -> None:
        """Keep the worker's queue past its engine's prefix limit where the look's twin says that pays,
        at it where it says that loses; a look inside the twin's noise leaves it as it is
        (:mod:`proxy.control.queue_side`). No restart. Only ``auto`` moves it; journaled when it changes."""
        price = plan.queue
        if price is None or not (price.pays or price.loses) or price.pays == w.queue_past:
            return
        auto = self._roster.mode is ControlMode.AUTO
        if auto:
            self._surroundings.keep_queue_past(job.worker_id, price.pays)
        w.queue_past = price.pays
        at, past = price.at_limit, price.past_limit
        evidence = QueueSide(queue_at_limit=price.at, queue_past_limit=price.past,
                             predicted_at_limit=round(at.output_tok_per_s, 2),
                             predicted_past_limit=round(past.output_tok_per_s, 2),
                             at_limit_answer_s=_rounded(at.mean_answer_s),
                             past_limit_answer_s=_rounded(past.mean_answer_s))  # fmt: skip
        side = (f"keep its queue at {price.past}, past the {price.at} where its engine stops ordering it by prefix"
                if price.pays else f"keep its queue at {price.at}, where its engine orders it by prefix")  # fmt: skip
        reason = (f"{side}: the twin writes {past.output_tok_per_s:.0f} tok/s past it against "
                  f"{at.output_tok_per_s:.0f} at it, answers in {_rounded(past.mean_answer_s)} s against "
                  f"{_rounded(at.mean_answer_s)} s")  # fmt: skip
        self._journal_lever(w, job, "queue_side", reason, evidence, now, "the gate")

    def _knob_change(self, w: Tracked, old: dict[str, object], new: dict[str, object]) -> KnobChange | None:
        """The knob a plan moves, where it moves exactly one argument, a knob's, to a number (else None)."""
        moved = [k for k in new if old.get(k) != new.get(k)]
        if len(moved) != 1:
            return None
        arg = moved[0]
        knob = next((k for k, spec in self._roster.rules.knobs.items() if spec.arg == arg), None)
        before, after = old.get(arg), new[arg]
        if knob is None or not isinstance(after, (int, float)):
            return None
        prior = before if isinstance(before, (int, float)) else w.state.resolved.get(arg)
        direction = 1 if prior is None or after > prior else -1
        return KnobChange(knob=str(knob), arg=arg, old=prior, new=float(after), direction=direction)

    def _note(self, w: Tracked, plan: Plan, decision: Decision, now: float) -> None:
        """Journal the twin's view of a plan that does not restart the worker: one that pays on too few
        plans yet (one look across the line among many is chance, not a trend), or one that does not pay
        (noted once per cool-down, with how well the twin predicts the worker now)."""
        roster, k = self._roster, self._roster.constants
        note = replace(decision, action=Action.NOTE, new_args=decision.old_args, change=None)  # no restart
        confirm = k.plan_confirmations
        if plan.worth:
            roster.journal.record(note, mode=roster.mode, status=Status.NOTED, before=w.window.summary(),
                                  detail=f"pays on {w.looks.paying} plan(s) of the {confirm} a restart needs, none saying no since",
                                  extra={"predicted_gain": round(plan.predicted_gain, 4)})  # fmt: skip
            return
        error = plan.current_error  # the twin on the requests it replayed, against what they got
        accuracy = {"current_prediction_error": round(error, 4)} if error is not None else {}
        key = "note:planner"
        last = w.state.noted.get(key)
        if last is None or now - last >= max(k.cooldown_s, k.plan_interval_s):
            w.state = w.state.note(key, now)
            roster.journal.record(note, mode=roster.mode, status=Status.NOTED, detail=plan.reason,
                                  before=w.window.summary(),
                                  extra={"predicted_gain": round(plan.predicted_gain, 4), **accuracy})  # fmt: skip

    def _restart_for_plan(
        self, w: Tracked, job: PlanJob, plan: Plan, decision: Decision, now: float, *, reshape_pending: bool = False
    ) -> Act | None:
        """A plan that pays, confirmed: refused by the rules' gate, advised, held back while an output
        budget's gain is measured on the worker or another restart or a canary is under way, or acted
        on (a canary beside two or more managed workers)."""
        roster = self._roster
        old, new = decision.old_args, decision.new_args  # the plan's own dicts, as decided
        base = plan.current.output_tok_per_s  # the work in flight computed again at the current pace
        # the work taken back: its prompts and what it kept prefilled again, what it lost decoded again
        settle = plan.refill_s + (job.inputs.cost.recomputed_tokens / base if base > 0 else 0.0)
        extra = {
            "predicted_gain": round(plan.predicted_gain, 4),
            "predicted_throughput": decision.evidence_json()["predicted_throughput"],
            "outcome_settle_s": round(settle, 1),
        }
        why = gate(decision, w.state, roster.rules, now)
        if why is not None and not why.startswith("flip guard"):  # the economics replace the flip guard
            roster.journal_once(w, decision, f"refused:planner:{why.split(':')[0]}", now, status=Status.REFUSED,
                                detail=why)  # fmt: skip
            return None
        if roster.mode is ControlMode.ADVISE or not w.managed:
            detail = "" if roster.mode is ControlMode.ADVISE else "worker is not managed by this proxy"
            roster.journal.record(decision, mode=roster.mode, status=Status.ADVISED, detail=detail,
                                  before=w.window.summary(), extra=extra)  # fmt: skip
            return None
        measured = next(iter(w.pending_budgets.values()), None)
        if measured is not None:  # a restart would end the budget's check: one change at a time
            roster.journal_once(w, decision, "wait:budget", now, status=Status.REFUSED, extra=extra,
                                detail=f"output budget #{measured.entry_id} is being measured on this worker: "
                                "a restart waits until its gain is in")  # fmt: skip
            return None
        if reshape_pending:  # the reshape replaces the worker: in the reshape benchmark a plan restarted the
            # tp-8 worker 11 s before the reshape restarted it again
            roster.journal_once(w, decision, "wait:reshape", now, status=Status.REFUSED, extra=extra,
                                detail="a reshape of the pool paid on its last look: the next look decides")  # fmt: skip
            return None
        waiting_for = self._trials.restart_under_way(w)
        if waiting_for is not None:  # due again as soon as the fleet is whole (plans_due)
            w.looks = replace(w.looks, held_back=new)
            roster.journal_once(w, decision, f"wait:{waiting_for[0]}", now, status=Status.REFUSED,
                                detail=waiting_for[1])  # fmt: skip
            return None
        fleet = len(roster.managed()) >= 2
        entry_id = roster.journal.record(decision, mode=roster.mode, status=Status.ACTING, before=w.window.summary(),
                                         extra={**extra, "canary": job.worker_id} if fleet else extra)  # fmt: skip
        if fleet:
            self._trials.begin(w, entry_id, old, new, promote_above=pays_above(plan.cost_tokens, base, plan.accrues_s))
        w.move(Phase.ACTING)
        return Act(decision=decision, entry_id=entry_id, settle_s=settle,
                   expectation=Expectation(plan.twin, new, plan.basis, old_args=old))  # fmt: skip
