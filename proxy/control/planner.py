"""The planner: a calibrated twin of a worker replays its recent workload under candidate arguments.

A :class:`Plan` (:func:`plan`; :func:`run_plan` calibrates first, off the event loop): the twin is
calibrated on the worker's own signals (:mod:`proxy.control.twin`); the newest requests, with the work
in flight beside them (:mod:`proxy.control.workload`), are replayed under the current arguments and a
bounded set of candidates (:mod:`proxy.control.candidates`); the best is worth a restart only when its
predicted gain over the horizon (:mod:`proxy.control.horizon`) pays the restart cost measured on this
worker (:mod:`proxy.control.economics`), or, where the worker keeps up, when the waiting it saves pays
the waiting the restart adds (:mod:`proxy.control.waiting`). A gain inside the twin's error says
neither way. The verdict is computed in numbers and a why-code (:mod:`proxy.control.verdict`), its
words apart (:mod:`proxy.control.explain`). :class:`Looks` is what the earlier looks said.

An acted plan is checked on the requests served under its arguments (:mod:`proxy.control.outcome`).
The names the controller and the proxy use are all importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.control.candidates import args_key, candidates, newest_sample
from proxy.control.economics import ERROR_LOOKS, PlanSettings, RestartCost, outage_waiting_s, twin_error
from proxy.control.explain import explain
from proxy.control.hold import HoldPrice
from proxy.control.outcome import Expectation, Outcome, OutcomeInputs, check_outcome
from proxy.control.peers import PeerCandidate
from proxy.control.queue_side import QueuePrice
from proxy.control.twin import DecodeStats, Prediction, Twin, calibrate
from proxy.control.verdict import Verdict, Why, verdict
from proxy.control.workload import InFlight, Observed, Replay, continued, measured_throughput, replay
from proxy.sim.config import SimConfigError
from proxy.sim.steptime import startup_seconds
from proxy.sim.twin import graph_max_bs

__all__ = [
    "ERROR_LOOKS",
    "DecodeStats",
    "Expectation",
    "HoldPrice",
    "InFlight",
    "Looks",
    "Observed",
    "Outcome",
    "OutcomeInputs",
    "Plan",
    "PlanInputs",
    "PlanSettings",
    "Prediction",
    "Replay",
    "RestartCost",
    "Twin",
    "Verdict",
    "Why",
    "args_key",
    "calibrate",
    "candidates",
    "check_outcome",
    "continued",
    "explain",
    "measured_throughput",
    "outage_waiting_s",
    "plan",
    "replay",
    "run_plan",
    "twin_error",
    "verdict",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    twin: Twin
    current: Prediction
    best: Prediction  # ``current`` when no candidate beats it
    predicted_gain: float  # best / current throughput - 1
    gain_tokens: float  # (best - current) throughput x the seconds it accrues over
    accrues_s: float  # the horizon, or less where the work waiting is expected gone sooner (the throughput basis)
    cost_tokens: float
    worth: bool  # restart with best.args
    # the gain would pay a restart, but it is inside how far the twin is from the worker on the same
    # requests: the plan can say neither that a restart pays nor that it does not
    undecided: bool = False
    replays: int
    reason: str
    refused: tuple[Prediction, ...] = field(default=())  # candidates outside the memory band
    measured_current: float | None = None  # what the worker did on the replayed requests (same basis)
    # what the restart is for: "throughput" (more tokens per second: a backlog) or "waiting" (the same
    # tokens, answered sooner: arrivals the worker keeps up with, or nearly)
    basis: str = "throughput"
    wait_saved_s: float = 0.0  # request-seconds of waiting the best args save over the horizon
    wait_cost_s: float = 0.0  # request-seconds of waiting the restart adds
    utilization: float | None = None  # the waiting basis: the work arriving over what the new args can do
    refill_s: float = 0.0  # after the restart, the time to prefill again what it took back (the cost's)
    # each served candidate's throughput gain over the current args on this look (:func:`args_key`)
    gains: Mapping[str, float] = field(default_factory=dict)
    # each candidate's request-seconds of waiting saved over the horizon on this look
    # (:func:`~proxy.control.waiting.waiting_savings`; empty: the waiting basis was not asked)
    savings: Mapping[str, float] = field(default_factory=dict)
    # holding the worker at its CUDA graphs' batch, which the fast tier does with no restart (None: the
    # current args never ran past the graphs on this look's replay)
    hold: HoldPrice | None = None
    # its queue kept past its engine's prefix limit, which the gate does with no restart (None: no such
    # limit; :mod:`proxy.control.queue_side`)
    queue: QueuePrice | None = None
    peer: PeerCandidate | None = None  # ``best`` is the peers' arguments, at the gain measured on them

    @property
    def current_error(self) -> float | None:
        """|predicted - measured| / measured throughput of the current args on the replayed requests."""
        m, p = self.measured_current, self.current.answered_tok_per_s
        return abs(p - m) / m if m and p is not None else None


def plan(
    twin: Twin,
    args: Mapping[str, object],
    workload: Sequence[Observed],
    cost: RestartCost,
    settings: PlanSettings,
    resolved: Mapping[str, float] | None = None,
    in_flight: Sequence[InFlight] = (),
    now: float | None = None,
    earlier_errors: Sequence[float] = (),
    earlier_gains: Sequence[Mapping[str, float]] = (),
    earlier_savings: Sequence[Mapping[str, float]] = (),
) -> Plan:
    """Replay the newest requests, with the work in flight alongside them, under ``args`` and the
    candidates; restart only if it pays (:func:`verdict`, in words by :func:`explain`). ``earlier_errors``:
    the twin's error on the worker's earlier looks under the same args, newest last (:func:`twin_error`);
    ``earlier_gains``: the candidates' gains (:attr:`Plan.gains`) on the earlier looks that said a restart
    pays, none saying no since: a candidate is chosen, and the restart weighed, on its mean gain over
    those looks and this one; ``earlier_savings``: the candidates' waiting saved (:attr:`Plan.savings`)
    on the earlier looks that asked the waiting basis, whatever they said: the waiting basis weighs its
    mean over them and this one."""
    if settings.engine_queue is not None:  # the proxy's gate in front of the worker: in front of the twin too
        twin = replace(
            twin,
            queue_cap=settings.engine_queue,
            gate_period_s=settings.gate_period_s,
            prefix_first=settings.prefix_first,
        )
    v = verdict(twin, args, workload, cost, settings, resolved, in_flight, now, earlier_errors, earlier_gains,
                earlier_savings)  # fmt: skip
    reason = explain(v, args, settings, len(earlier_errors))
    throughput = Plan(
        twin=twin,
        current=v.current,
        best=v.best,
        predicted_gain=v.gain,
        gain_tokens=v.gain_tokens,
        accrues_s=v.accrues_s,
        cost_tokens=v.cost_tokens,
        refill_s=cost.refill_s,
        gains=v.gains,
        savings=v.savings,
        worth=v.pays and v.trusted,
        replays=v.replays,
        reason=reason,
        refused=v.refused,
        measured_current=v.measured,
        undecided=v.pays and not v.trusted,
        hold=v.hold,
        queue=v.queue,
        peer=v.peer,
    )
    if v.why is not Why.WAITING_PAYS or v.waiting is None:
        return throughput
    quicker, base = v.waiting.quicker, v.base
    return replace(
        throughput,
        best=quicker,
        predicted_gain=quicker.output_tok_per_s / base - 1.0 if base > 0 else 0.0,
        gain_tokens=(quicker.output_tok_per_s - base) * settings.horizon_s,
        accrues_s=settings.horizon_s,
        worth=True,
        undecided=False,
        basis="waiting",
        wait_saved_s=v.waiting.saved_s,
        wait_cost_s=v.waiting.cost_s,
        utilization=v.waiting.utilization,
    )


@dataclass(frozen=True, slots=True)
class Looks:
    """What a worker's plans under its current arguments said, as its next plan and the controller read
    them; a restart starts them afresh (:meth:`after` folds in each new look).

    ``paying``: looks in a row that said a restart pays, none since saying it does not (a look inside the
    twin's error says neither and leaves the count); ``errors``: the twin's error on each look's requests,
    the newest ``ERROR_LOOKS - 1`` (:func:`twin_error`); ``gains``: the candidates' gains on the paying
    looks of the count (throughput basis), which the confirming look chooses on; ``savings``: the
    candidates' waiting saved on the newest ``ERROR_LOOKS - 1`` looks that asked the waiting basis, paying
    or not (:func:`~proxy.control.waiting.waiting_basis` weighs their mean); ``held_back``: the arguments
    of the last look's restart, which paid but waited for another worker's (one restart at a time): the
    worker is due its next look as soon as the fleet is whole again, not a whole ``plan_interval_s``
    later, and a canary's promotion that reaches it first carries them too."""

    paying: int = 0
    errors: tuple[float, ...] = ()
    gains: tuple[Mapping[str, float], ...] = ()
    savings: tuple[Mapping[str, float], ...] = ()
    held_back: Mapping[str, object] | None = None

    def after(self, plan: Plan) -> Looks:
        """These looks and ``plan``'s (not yet held back: the controller says so when it is)."""
        errors = self.errors
        if plan.current_error is not None:
            errors = (*errors, plan.current_error)[-(ERROR_LOOKS - 1) :]
        savings = (*self.savings, plan.savings)[-(ERROR_LOOKS - 1) :] if plan.savings else self.savings
        if plan.undecided:
            return Looks(paying=self.paying, errors=errors, gains=self.gains, savings=savings)
        gains = (*self.gains, plan.gains)[-(ERROR_LOOKS - 1) :] if plan.worth and plan.basis == "throughput" else ()
        return Looks(paying=self.paying + 1 if plan.worth else 0, errors=errors, gains=gains, savings=savings)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """Everything one plan of one worker reads (collected on the event loop, planned off it)."""

    gpu: str
    model: str
    args: Mapping[str, object]
    resolved: Mapping[str, float]
    decode: tuple[DecodeStats, ...]
    kv_capacity_tokens: int | None
    workload: tuple[Observed, ...]
    cost: RestartCost
    settings: PlanSettings
    in_flight: tuple[InFlight, ...] = ()  # open on the worker at ``now``
    now: float | None = None
    looks: Looks = field(default_factory=Looks)  # what the earlier looks under these args said


def run_plan(inputs: PlanInputs) -> Plan:
    """Calibrate the twin on the worker's signals, then plan (CPU-bound: a few bounded replays)."""
    loaded = replay(newest_sample(inputs.workload, inputs.settings), inputs.workload, inputs.in_flight, inputs.now)
    twin = calibrate(inputs.gpu, inputs.model, inputs.args, inputs.decode, inputs.kv_capacity_tokens, loaded)
    cost = inputs.cost
    if cost.refill_prompt_tokens > 0:
        cost = replace(
            cost, refill_s=twin.prefill_seconds(inputs.args, cost.refill_prompt_tokens, cost.refill_requests)
        )
    if cost.startup_s is None:  # no start of this worker seen: the twin's own start-up, on its calibrated clock
        try:
            cfg = twin.config(inputs.args)
            modelled = startup_seconds(cfg.weights_bytes, graph_max_bs(cfg))[2]
            cost = replace(cost, startup_s=modelled * twin.step_time_factor)
        except SimConfigError:
            pass
    return plan(
        twin,
        inputs.args,
        inputs.workload,
        cost,
        inputs.settings,
        inputs.resolved,
        inputs.in_flight,
        inputs.now,
        inputs.looks.errors,
        inputs.looks.gains,
        inputs.looks.savings,
    )
