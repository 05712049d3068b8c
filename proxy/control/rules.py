"""The controller's safety net: pure functions ``(window, state, settings) -> Decision | None``.

Each rule is one row of the rules table in docs/controller.md; the engine's knob table
(``proxy.engines.<engine>.knobs``) says which argument a knob is. Thresholds and steps are the
controller's constants (``proxy.control.constants``), the range of each argument the policy's
``control.bounds``. What each rule decided on is a frozen value of ``proxy.control.evidence``.

:data:`ON_DEATH` are read when a worker has died (out of memory, a crash loop, a KV pool too small
to start); :data:`SAFETY_NET_SERVING` on every tick of a serving worker (the start-up line's memory
band and activations; on an engine the planner does not model, a preemption cap). Tuning restarts
are the planner's. :func:`evaluate` passes each decision through :func:`gate` (cool-down, restart
budget, flip guard); the first one admitted wins, the refused ones are returned for the journal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.control.activations import Activations, covering_graphs, decode_split_mib
from proxy.control.constants import CONSTANTS, Constants
from proxy.control.decision import Action, ControlState, Decision, KnobChange, RuleKind
from proxy.control.evidence import (
    ActivationFit,
    BatchCapStorm,
    CrashLoop,
    DecodeOom,
    Evidence,
    GraphCover,
    KvCapacity,
    MemoryBand,
    PrefillOom,
    RequestFit,
    Retractions,
    TimidPacing,
    UnplacedOom,
)
from proxy.control.window import Window
from proxy.engines.base import EventKind, Knob, KnobName, LogEvent
from proxy.policy import ControlSettings

__all__ = [
    "LAUNCH",
    "ON_DEATH",
    "RULES",
    "SAFETY_NET_SERVING",
    "START_UP",
    "Evaluation",
    "Rule",
    "RuleSettings",
    "before_launch",
    "crash_loop_unbroken",
    "evaluate",
    "gate",
    "revive_delay",
]


@dataclass(frozen=True, slots=True)
class RuleSettings:
    control: ControlSettings
    knobs: Mapping[KnobName, Knob]  # the engine's knob table
    # the worker's activations under its arguments (None, or a None answer: no model of them)
    activations: Callable[[Mapping[str, object]], Activations | None] | None = None
    constants: Constants = CONSTANTS  # on the controller's clock (:meth:`Constants.in_wall`)

    def bounds(self, name: KnobName) -> tuple[float, float]:
        """The range ``name`` may move in: the policy's ``control.bounds`` for its engine argument, else
        the constants' default for the knob (none: the knob's own), within what the engine takes."""
        knob = self.knobs.get(name)
        given = self.control.bound(knob.arg) if knob is not None else None
        low, high = given or self.constants.bounds.get(name, (-math.inf, math.inf))
        if knob is not None:
            low, high = max(low, knob.minimum), min(high, knob.maximum)
        return (low, high)


Rule = Callable[[Window, ControlState, RuleSettings], "Decision | None"]


# -- helpers ------------------------------------------------------------------------------------


def _current(knob: Knob, window: Window, state: ControlState) -> float | None:
    """The knob's value: the arg, else the engine's start-up line, else what state resolved, else default."""
    if knob.arg not in state.args and knob.resolved_field and window.startup is not None:
        value = window.startup.fields.get(knob.resolved_field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return state.current(knob)


def _move(
    window: Window,
    state: ControlState,
    s: RuleSettings,
    *,
    rule: str,
    kind: RuleKind,
    knob_name: KnobName,
    new_value: float,
    direction: int,
    reason: str,
    evidence: Evidence,
) -> Decision | None:
    """A restart that moves one knob to ``new_value``; None if that is no move in ``direction``."""
    knob = s.knobs.get(knob_name)
    if knob is None:
        return None
    old = _current(knob, window, state)
    new = knob.clamp(new_value)
    if old is not None and (new - old) * direction <= 0:
        return None
    return Decision(
        worker_id=state.worker_id,
        rule=rule,
        reason=reason.format(arg=knob.arg, old=_fmt(old), new=_fmt(new)),
        time=window.now,
        evidence=evidence,
        old_args=state.args,
        new_args={**state.args, knob.arg: new},
        kind=kind,
        change=KnobChange(knob=str(knob_name), arg=knob.arg, old=old, new=new, direction=direction),
    )


def _fmt(value: float | None) -> str:
    return "unset" if value is None else f"{value:g}"


def _last_oom(window: Window, phase: str | None) -> LogEvent | None:
    for event in reversed(window.events):
        if event.kind is EventKind.OOM and (phase is None or event.fields.get("phase") == phase):
            return event
    return None


def _oom_text(oom: LogEvent) -> str:
    return str(oom.fields.get("exception") or (oom.line.splitlines() or [""])[0])[:200]


def _memory_down(
    window: Window, state: ControlState, s: RuleSettings, *, rule: str, kind: RuleKind, why: str, evidence: Evidence
) -> Decision | None:
    knob = s.knobs.get(KnobName.MEMORY_FRACTION)
    if knob is None:
        return None
    current = _current(knob, window, state)
    if current is None:
        return None  # an unknown fraction cannot be stepped
    low = s.bounds(KnobName.MEMORY_FRACTION)[0]
    new = max(current - s.constants.memory_fraction_step, low)
    return _move(
        window, state, s, rule=rule, kind=kind, knob_name=KnobName.MEMORY_FRACTION, new_value=new, direction=-1,
        reason=why + ": lower {arg} {old} -> {new}", evidence=evidence,
    )  # fmt: skip


def _number(value: object) -> float | None:
    """A number of a log event's fields (a flag is not one), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _startup_mem(window: Window) -> float | None:
    if window.startup is None:
        return None
    value = window.startup.fields.get("available_gpu_mem_gb")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _startup_mem_rounding(window: Window) -> float:
    """How far below the start-up line's free memory the true figure may be (the engine's reader says
    how it was rounded; 0: not said). A batch sized to the printed figure can pass the true one by a
    few requests, and dies there."""
    rounding = _number(window.startup.fields.get("available_gpu_mem_rounding_gb")) if window.startup else None
    return float(rounding or 0.0)


# -- the rules ----------------------------------------------------------------------------------


def prefill_oom(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Out of memory in prefill: a smaller prefill chunk (8192 -> 4096 -> 2048), then less KV memory."""
    oom = _last_oom(window, "prefill")
    if oom is None:
        return None
    evidence = PrefillOom(oom_cause=str(oom.fields.get("cause", "")), log=_oom_text(oom))
    chunk = s.knobs.get(KnobName.PREFILL_CHUNK)
    if chunk is not None:
        current = _current(chunk, window, state)
        new = (
            chunk.rung_below(current, floor=s.bounds(KnobName.PREFILL_CHUNK)[0])
            if current is not None
            else max(4096, s.bounds(KnobName.PREFILL_CHUNK)[0])
        )
        if new is not None:
            decision = _move(
                window, state, s, rule="prefill_oom", kind=RuleKind.SAFETY, knob_name=KnobName.PREFILL_CHUNK,
                new_value=new, direction=-1, evidence=evidence,
                reason="out of memory during prefill: lower {arg} {old} -> {new}",
            )  # fmt: skip
            if decision is not None:
                return decision
    return _memory_down(
        window,
        state,
        s,
        rule="prefill_oom",
        kind=RuleKind.SAFETY,
        why="out of memory during prefill with the smallest chunk",
        evidence=evidence,
    )


def decode_oom(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Out of memory in decode: where the KV pool had room to spare, its memory goes to the activations
    (:func:`_pool_to_activations`); else the running batch is capped below the peak seen, then less KV
    memory."""
    oom = _last_oom(window, "decode")
    if oom is None:
        return None
    peak, usage = window.peak_running, window.peak_token_usage
    evidence = DecodeOom(oom_cause=str(oom.fields.get("cause", "")), peak_running=peak, log=_oom_text(oom),
                         peak_token_usage=None if usage is None else round(usage, 3))  # fmt: skip
    if usage is not None and usage <= s.constants.spare_pool_usage:
        roomier = _pool_to_activations(window, state, s, evidence)
        if roomier is not None:
            return roomier
    knob = s.knobs.get(KnobName.MAX_RUNNING)
    if knob is not None:
        current = _current(knob, window, state)
        seen = [v for v in (peak, current) if v]
        if seen:
            new = max(s.bounds(KnobName.MAX_RUNNING)[0], int(min(seen) * s.constants.decode_oom_factor))
            decision = _move(
                window, state, s, rule="decode_oom", kind=RuleKind.SAFETY, knob_name=KnobName.MAX_RUNNING,
                new_value=new, direction=-1, evidence=evidence,
                reason="out of memory during decode (peak running batch " + _fmt(peak) + "): lower {arg} {old} -> {new}",
            )  # fmt: skip
            if decision is not None:
                return decision
    return _memory_down(
        window,
        state,
        s,
        rule="decode_oom",
        kind=RuleKind.SAFETY,
        why="out of memory during decode at the smallest batch cap",
        evidence=evidence,
    )


def _pool_to_activations(window: Window, state: ControlState, s: RuleSettings, evidence: DecodeOom) -> Decision | None:
    """A decode OOM while the KV pool was at most ``spare_pool_usage`` full: the batch the pool admits is
    the one to keep, and the memory its activations lacked comes out of the pool. The fraction comes
    down so the free memory grows by the cap's margin (``1 / decode_oom_factor``: the batch that died,
    a quarter larger, fits); the running cap stays. The GPU's total is at least ``free / (1 -
    fraction)``, so the step may free more than that."""
    knob = s.knobs.get(KnobName.MEMORY_FRACTION)
    free = _startup_mem(window)
    current = _current(knob, window, state) if knob is not None else None
    if knob is None or free is None or current is None or not 0.0 < current < 1.0:
        return None
    more = free * (1.0 / s.constants.decode_oom_factor - 1.0)
    new = max(
        math.floor((current - more * (1.0 - current) / free) * 1000) / 1000, s.bounds(KnobName.MEMORY_FRACTION)[0]
    )
    if new >= current:
        return None
    used = evidence.peak_token_usage
    return _move(
        window, state, s, rule="decode_oom", kind=RuleKind.SAFETY, knob_name=KnobName.MEMORY_FRACTION,
        new_value=new, direction=-1, evidence=evidence,
        reason=f"out of memory during decode (peak running batch {_fmt(evidence.peak_running)}) with the KV pool "
        f"at most {used:.0%} full: {more:.2f} GB more for the activations from the pool: lower {{arg}} {{old}} -> {{new}}",
    )  # fmt: skip


def oom_unknown_phase(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Out of memory the log does not place in prefill or decode: less KV memory helps both."""
    oom = _last_oom(window, None)
    if oom is None or oom.fields.get("phase") in ("prefill", "decode"):
        return None
    return _memory_down(
        window,
        state,
        s,
        rule="oom",
        kind=RuleKind.SAFETY,
        why="out of memory",
        evidence=UnplacedOom(log=_oom_text(oom)),
    )


def crash_loop(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Repeated deaths: go back to the last arguments that ran well (the policy's, if none did)."""
    c = s.constants
    deaths = state.deaths_within(window.now, c.crash_loop_window_s)
    if deaths < c.crash_loop:
        return None
    fallback = _crash_loop_fallback(state)
    if dict(fallback) == dict(state.args):
        return None  # nothing to go back to: crash_loop_unbroken notes it
    return Decision(
        worker_id=state.worker_id,
        rule="crash_loop",
        reason=f"{deaths} deaths in {c.crash_loop_window_s:g} s: back to the last arguments that ran well",
        time=window.now,
        evidence=CrashLoop(
            deaths=deaths,
            window_s=c.crash_loop_window_s,
            fallback="last_good" if state.last_good_args is not None else "policy",
        ),
        old_args=state.args,
        new_args=fallback,
        kind=RuleKind.SAFETY,
        delay_s=revive_delay(state, s.constants, window.now),
    )


def _crash_loop_fallback(state: ControlState) -> Mapping[str, object]:
    return state.last_good_args if state.last_good_args is not None else state.initial_args


def crash_loop_unbroken(state: ControlState, c: Constants, now: float, death: str) -> Decision | None:
    """A crash loop :func:`crash_loop` cannot break: the worker already runs the arguments it would go
    back to, so each death only revives it, after the crash back-off. A note, once per loop (until
    the controller clears ``state.crash_loop_noted``: a death alone in the window ends the loop),
    with the deaths and the last one's cause (``death``, in words)."""
    deaths = state.deaths_within(now, c.crash_loop_window_s)
    if deaths < c.crash_loop or state.crash_loop_noted or dict(_crash_loop_fallback(state)) != dict(state.args):
        return None
    whose = "the last arguments that ran well" if state.last_good_args is not None else "the policy's arguments"
    return Decision(
        worker_id=state.worker_id,
        rule="crash_loop",
        reason=f"crash loop: {deaths} deaths in {c.crash_loop_window_s:g} s, the last: {death}; it runs {whose}, "
        f"nothing to go back to: revived after each death (crash back-off up to {c.crash_backoff_s[-1]:g} s)",
        time=now,
        evidence=CrashLoop(
            deaths=deaths,
            window_s=c.crash_loop_window_s,
            fallback="last_good" if state.last_good_args is not None else "policy",
            last_death=death,
        ),
        old_args=state.args,
        new_args=state.args,
        action=Action.NOTE,
        kind=RuleKind.SAFETY,
    )


def retraction_storm(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """On an engine the planner's twin does not model (one without admission conservativeness: vLLM),
    preemptions that are a real share of the work cap the running batch; elsewhere the planner prices
    the same storm and this rule says nothing.

    A storm is relative: more than ``retractions_per_1k_tokens`` retracted requests per 1,000 output
    tokens generated in the window (an absolute rate per minute grows with throughput). The constants'
    ``retractions_per_min`` stays a noise floor: below it nothing fires. Without a throughput figure the
    floor alone decides."""
    if KnobName.CONSERVATIVENESS in s.knobs:
        return None  # the planner's
    c = s.constants
    if window.observed_s < c.min_evidence_s:
        return None
    rate = window.retraction_rate_per_min
    if rate <= c.retractions_per_min:
        return None
    per_1k = window.retractions_per_1k_tokens
    if per_1k is not None and per_1k <= c.retractions_per_1k_tokens:
        return None
    storm = Retractions(
        retraction_rate_per_min=round(rate, 2), threshold_per_min=round(c.retractions_per_min, 2),
        retractions_per_1k_tokens=None if per_1k is None else round(per_1k, 4),
        threshold_per_1k_tokens=c.retractions_per_1k_tokens,
        retractions=window.retractions, observed_s=round(window.observed_s, 1),
    )  # fmt: skip
    why = f"{rate:.1f} retractions/min" + (
        "" if per_1k is None else f", {per_1k:.3f} per 1k output tokens (> {c.retractions_per_1k_tokens:g})"
    )
    return _fewer_running(window, state, s, why, storm)


def _fewer_running(
    window: Window, state: ControlState, s: RuleSettings, why: str, storm: Retractions
) -> Decision | None:
    """Cap the running batch at the number of whole requests the KV pool holds: its capacity over the
    mean prompt + output length of the requests that finished in the window (preemptions come from
    running more requests than fit once they have grown to full length). Where that figure is
    missing or not below what the full pool held while it preempted, cap below the latter instead:
    the median running count of the samples with token usage >= ``low_usage`` (else the peak seen)
    x ``decode_oom_factor``, since requests caught mid-way still grow."""
    c = s.constants
    floor = s.bounds(KnobName.MAX_RUNNING)[0]
    full = sorted(smp.running for smp in window.samples if smp.token_usage >= c.low_usage and smp.running > 0)
    held = full[len(full) // 2] if full else (window.peak_running or 0)
    if held <= 0:
        return None
    fit = _whole_requests_that_fit(window)
    if fit is not None and fit.requests_that_fit < held:
        fits, capacity, length = fit.requests_that_fit, fit.kv_capacity_tokens, fit.mean_request_tokens
        return _move(
            window, state, s, rule="retraction_storm", kind=RuleKind.CORRECTIVE, knob_name=KnobName.MAX_RUNNING,
            new_value=max(fits, floor), direction=-1,
            evidence=BatchCapStorm(storm=storm, running_when_kv_full=held, fit=replace(fit, mean_request_tokens=round(length, 1))),
            reason=f"{why} with about {held} requests running when the "
            + f"KV cache is full; {fits} whole requests of {length:.0f} tokens fit its {capacity} tokens: "
            + "lower {arg} {old} -> {new}",
        )  # fmt: skip
    return _move(
        window, state, s, rule="retraction_storm", kind=RuleKind.CORRECTIVE, knob_name=KnobName.MAX_RUNNING,
        new_value=max(int(held * c.decode_oom_factor), floor), direction=-1,
        evidence=BatchCapStorm(storm=storm, running_when_kv_full=held),
        reason=f"{why} with about {held} requests running when the KV cache is full: " + "lower {arg} {old} -> {new}",
    )  # fmt: skip


def _whole_requests_that_fit(window: Window) -> RequestFit | None:
    """How many requests of the mean whole length (prompt + output) of those that finished in the
    window fit the KV pool at once."""
    capacity, length = window.kv_capacity_tokens, window.mean_request_tokens
    if capacity is None or length is None:
        return None
    return RequestFit(
        kv_capacity_tokens=capacity, mean_request_tokens=length, requests_that_fit=int(capacity // length)
    )


def kv_capacity(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """The engine refused to start because one request of its configured length does not fit the
    KV cache: lower that length to what the engine says fits; without that figure, raise the memory
    fraction (within bounds)."""
    event = window.last(EventKind.KV_CAPACITY_ERROR)
    if event is None or event.fields.get("fatal") is False:
        return None
    fits = _number(event.fields.get("estimated_max_context"))
    evidence = KvCapacity(
        log=event.line.splitlines()[0][:200] if event.line else "",
        max_context=_number(event.fields.get("max_context")), estimated_max_context=fits,
        needed_gib=_number(event.fields.get("needed_gib")), available_gib=_number(event.fields.get("available_gib")),
    )  # fmt: skip
    if fits is not None and fits > 0:
        decision = _move(
            window, state, s, rule="kv_capacity", kind=RuleKind.SAFETY, knob_name=KnobName.MAX_CONTEXT,
            new_value=fits, direction=-1, evidence=evidence,
            reason="the KV cache cannot hold one request of the configured length: lower {arg} {old} -> {new}",
        )  # fmt: skip
        if decision is not None:
            return decision
    knob = s.knobs.get(KnobName.MEMORY_FRACTION)
    current = _current(knob, window, state) if knob else None
    if current is None:
        return None
    high = s.bounds(KnobName.MEMORY_FRACTION)[1]
    return _move(
        window, state, s, rule="kv_capacity", kind=RuleKind.SAFETY, knob_name=KnobName.MEMORY_FRACTION,
        new_value=min(current + s.constants.memory_fraction_step, high), direction=+1, evidence=evidence,
        reason="the KV cache cannot hold one request of the configured length: raise {arg} {old} -> {new}",
    )  # fmt: skip


def memory_low(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Less free device memory at start-up than the floor: risk of OOM, shrink the KV pool. The floor
    is what a full prefill chunk needs (:meth:`Activations.free_floor_gb`) where the twin's model is
    this worker's, else the band's low end."""
    free = _startup_mem(window)
    low = startup_floor_gb(window, state, s)
    if free is None or free >= low:
        return None
    return _memory_down(
        window, state, s, rule="memory_low", kind=RuleKind.CORRECTIVE, why=f"{free:g} GB free at start-up (< {low:g} GB)",
        evidence=MemoryBand(available_gpu_mem_gb=free, band_gb=f"{low:g}-{s.constants.available_mem_band_gb[1]:g}"),
    )  # fmt: skip


POOL_MATCH = 0.1  # the model's KV pool within this share of the reported one: the model is this worker's


def worker_activations(window: Window, state: ControlState, s: RuleSettings) -> Activations | None:
    """The twin's activations under the worker's arguments, where the KV pool the twin computes for
    them is the one the worker's start-up line reported (else the model is not this worker's: None)."""
    if s.activations is None or window.startup is None:
        return None
    pool = window.startup.fields.get("max_total_tokens")
    if not isinstance(pool, int) or pool <= 0:
        return None
    act = s.activations(state.args)
    if act is None or abs(act.pool_tokens - pool) > POOL_MATCH * pool:
        return None
    return act


def startup_floor_gb(window: Window, state: ControlState, s: RuleSettings) -> float:
    """The least free memory at start-up the worker should have: a full prefill chunk's activations
    with margin where the twin's model is the worker's, else the band's low end."""
    act = worker_activations(window, state, s)
    knob = s.knobs.get(KnobName.PREFILL_CHUNK)
    chunk = _current(knob, window, state) if knob is not None else None
    if act is None or chunk is None or chunk <= 0:
        return s.constants.available_mem_band_gb[0]
    return act.free_floor_gb(chunk)


def activations_fit(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """A crash foreseen from the start-up line: the activations of a full prefill chunk, or of the
    largest decode batch the running cap allows beyond the CUDA graphs, need more memory than the
    worker reported free. The prefill chunk steps down the knob's ladder to the highest rung that
    fits, then the running cap comes down to the batch that fits (no lower than the graphs' batch).
    The activations are the model's (:class:`Activations`), used only when the KV pool it computes
    for the same arguments is the one the worker reported; a model that is off by a margin is
    caught by the OOM rules when the crash comes."""
    act = worker_activations(window, state, s)
    free = _startup_mem(window)
    if act is None or free is None:
        return None
    free_mib = (free - _startup_mem_rounding(window)) * 1024

    chunk_knob = s.knobs.get(KnobName.PREFILL_CHUNK)
    chunk = _current(chunk_knob, window, state) if chunk_knob else None
    if chunk_knob is not None and chunk is not None and chunk > 0 and chunk * act.prefill_mib_per_token > free_mib:
        new: float | None = chunk
        while new is not None and new * act.prefill_mib_per_token > free_mib:
            new = chunk_knob.rung_below(new, floor=s.bounds(KnobName.PREFILL_CHUNK)[0])
        if new is not None:
            need_gb = chunk * act.prefill_mib_per_token / 1024
            return _move(
                window, state, s, rule="activations_fit", kind=RuleKind.CORRECTIVE,
                knob_name=KnobName.PREFILL_CHUNK, new_value=new, direction=-1,
                evidence=ActivationFit(available_gpu_mem_gb=free, need_gb=round(need_gb, 2), tokens=int(chunk),
                                       model=act.model),
                reason=f"a full prefill chunk of {chunk:g} tokens needs {need_gb:.2f} GB of activations, "
                f"{free:g} GB free at start-up: lower {{arg}} {{old}} -> {{new}}",
            )  # fmt: skip
    running_knob = s.knobs.get(KnobName.MAX_RUNNING)
    running = _current(running_knob, window, state) if running_knob else None
    if running_knob is None or running is None:
        return None
    need_gb = act.decode_gb(running)
    if need_gb <= free:
        return None
    evidence = ActivationFit(available_gpu_mem_gb=free, need_gb=round(need_gb, 2), batch=int(running),
                             graph_max_bs=act.graph_max_bs, model=act.model)  # fmt: skip
    why = (f"a decode batch of {running:g} requests needs {need_gb:.2f} GB of activations beyond the CUDA "
           f"graphs ({act.graph_max_bs}), {free:g} GB free at start-up")  # fmt: skip
    split = _pool_share_to_activations(window, state, s, act, free_mib=free_mib, why=why, evidence=evidence)
    if split is not None:
        return split
    return _move(
        window, state, s, rule="activations_fit", kind=RuleKind.CORRECTIVE, knob_name=KnobName.MAX_RUNNING,
        new_value=_decode_cap(act, s, free_mib), direction=-1, evidence=evidence,
        reason=why + ": lower {arg} {old} -> {new}",
    )  # fmt: skip


def _decode_cap(act: Activations, s: RuleSettings, free_mib: float) -> int:
    """The largest running cap whose decode batch fits ``free_mib`` (no lower than the graphs' batch)."""
    return max(act.graph_max_bs, int(s.bounds(KnobName.MAX_RUNNING)[0]), int(free_mib / act.decode_mib_per_seq))


def _pool_share_to_activations(
    window: Window,
    state: ControlState,
    s: RuleSettings,
    act: Activations,
    *,
    free_mib: float,
    why: str,
    evidence: ActivationFit,
) -> Decision | None:
    """One restart that lowers the memory fraction by :func:`decode_split_mib` and the running cap to
    the batch that fits the memory then free; None where the fraction cannot move (no knob, unknown
    fraction or GPU total, at its bound): the cap alone comes down."""
    frac_knob, cap_knob = s.knobs.get(KnobName.MEMORY_FRACTION), s.knobs.get(KnobName.MAX_RUNNING)
    current = _current(frac_knob, window, state) if frac_knob is not None else None
    running = _current(cap_knob, window, state) if cap_knob is not None else None
    if frac_knob is None or cap_knob is None or current is None or running is None or act.total_mib <= 0:
        return None
    per_gpu = act.total_mib / act.devices  # free_mib and the activations are one GPU's, as the line reports
    moved = decode_split_mib(free_mib, running * act.decode_mib_per_seq, act.pool_mib / act.devices)
    new = max(math.floor((current - moved / per_gpu) * 1000) / 1000, s.bounds(KnobName.MEMORY_FRACTION)[0])
    if new >= current:
        return None
    # the next line rounds again: the batch sized to what it may print at worst
    after_mib = free_mib + (current - new) * per_gpu - _startup_mem_rounding(window) * 1024
    cap = min(int(running), _decode_cap(act, s, after_mib))
    lowered = _move(
        window, state, s, rule="activations_fit", kind=RuleKind.CORRECTIVE, knob_name=KnobName.MEMORY_FRACTION,
        new_value=new, direction=-1, evidence=evidence,
        reason=why + f": the pool and the cap share the shortfall: lower {{arg}} {{old}} -> {{new}} and "
        f"{cap_knob.arg} {running:g} -> {cap}",
    )  # fmt: skip
    if lowered is None:
        return None
    return replace(lowered, new_args={**lowered.new_args, cap_knob.arg: cap})


def graphs_cover(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """Before a launch only (:data:`LAUNCH`): CUDA graphs that cover the decode batches the running cap
    allows (:func:`covering_graphs`), as far as the free memory at start-up keeps its floor and the
    decode batch the cap allows past them (the graphs take what those activations would use). SGLang's
    default is its GPU tier's, the least: on a 40 GB A100 at tp 1 it covers 32 where the pool holds
    ~130 chat requests, and every decode step past it runs uncaptured. The twin's figures, used only
    where its KV pool is the worker's. Never lowers them; graphs a person disabled (0) stay off. A
    running worker's graphs are the planner's lever."""
    act = worker_activations(window, state, s)
    knob = s.knobs.get(KnobName.GRAPH_MAX_BS)
    free = _startup_mem(window)
    if act is None or knob is None or free is None or act.graph_max_bs <= 0:
        return None
    running_knob = s.knobs.get(KnobName.MAX_RUNNING)
    running = _current(running_knob, window, state) if running_knob is not None else None
    target = covering_graphs(act, knob.ladder, running, s.bounds(KnobName.GRAPH_MAX_BS)[1])
    floor = startup_floor_gb(window, state, s)

    def fits(size: float) -> bool:
        """The graphs' memory comes out of what is free at start-up: what is left keeps the floor, and
        the decode batch the running cap allows (past the graphs) still fits it."""
        left = free - _startup_mem_rounding(window) - (size - act.graph_max_bs) * act.graph_mib_per_bs / 1024
        batch = act.decode_gb(running) if running is not None and running > size else 0.0
        return left >= max(floor, batch)

    sizes = [target, *sorted((r for r in knob.ladder if r < target), reverse=True)]
    up = next((int(size) for size in sizes if size > act.graph_max_bs and fits(size)), None)
    if up is None:
        return None
    graph_mib = up * act.graph_mib_per_bs
    return _move(
        window, state, s, rule="graphs_cover", kind=RuleKind.TUNING, knob_name=KnobName.GRAPH_MAX_BS,
        new_value=up, direction=1,
        evidence=GraphCover(graph_max_bs=act.graph_max_bs, graph_mib=graph_mib, pool_mib=round(act.pool_mib),
                            running_cap=None if running is None else int(running), available_gpu_mem_gb=free,
                            model=act.model),
        reason=f"the CUDA graphs cover decode batches up to {act.graph_max_bs} where the running cap allows "
        f"{'more' if running is None else f'{running:g}'}: graphs up to {up} take {graph_mib:g} MiB, "
        f"{graph_mib / act.pool_mib:.1%} of the KV pool; raise {{arg}} {{old}} -> {{new}}",
    )  # fmt: skip


def memory_headroom(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """More free device memory at start-up than the band's top: a bigger KV pool fits. One step to
    the fraction that leaves the middle of the band free: the static fraction takes ``fraction x
    total`` and the rest, less small fixed buffers, is what the start-up line reports free, so
    ``total`` is at least ``free / (1 - fraction)``; that lower bound makes the step a little
    long, which the band's width absorbs. At least ``memory_fraction_step``, within the bounds."""
    free = _startup_mem(window)
    low, high = s.constants.available_mem_band_gb
    if free is None or free <= high:
        return None
    knob = s.knobs.get(KnobName.MEMORY_FRACTION)
    current = _current(knob, window, state) if knob else None
    if current is None or current >= 1.0:
        return None
    total = free / (1.0 - current)
    target = current + (free - (low + high) / 2) / total
    new = min(max(target, current + s.constants.memory_fraction_step), s.bounds(KnobName.MEMORY_FRACTION)[1])
    return _move(
        window, state, s, rule="memory_headroom", kind=RuleKind.TUNING, knob_name=KnobName.MEMORY_FRACTION,
        new_value=round(new, 3), direction=+1,
        evidence=MemoryBand(available_gpu_mem_gb=free, band_gb=f"{low:g}-{high:g}", gpu_total_gb_at_least=round(total, 1)),
        reason=f"{free:g} GB free at start-up (> {high:g} GB): " + "raise {arg} {old} -> {new}",
    )  # fmt: skip


def pacing_too_timid(window: Window, state: ControlState, s: RuleSettings) -> Decision | None:
    """The server queue is often empty while the proxy holds requests the band would send: pacing sends
    too slowly (noted). Batch work its class's gates hold beside interactive work is not counted: it
    waits there by design."""
    c = s.constants
    if window.observed_s < c.min_evidence_s:
        return None
    fraction = window.timid_fraction()
    if fraction < c.timid_queue_fraction:
        return None
    return Decision(
        worker_id=state.worker_id,
        rule="pacing_too_timid",
        reason=f"server queue empty in {fraction:.0%} of samples while the proxy held requests the band would send: "
        "pacing sends too slowly",
        time=window.now,
        evidence=TimidPacing(queue_empty_fraction=round(fraction, 3), threshold_fraction=c.timid_queue_fraction),
        old_args=state.args,
        new_args=state.args,
        action=Action.NOTE,
    )


ON_DEATH: tuple[Rule, ...] = (kv_capacity, prefill_oom, decode_oom, oom_unknown_phase, crash_loop)
# the planner decides tuning and corrective restarts; while serving the rules keep only these: the
# free-memory band's two edges (a fact of the deployment read from the start-up line, whatever the
# traffic: acted on at start-up it costs a start-up and no work in flight, while a planner needs a
# workload to replay first), the crash the twin's activations foresee from the same line (the model is
# the planner's: without it the OOM rules learn the same from the crash), and the note on timid pacing
SAFETY_NET_SERVING: tuple[Rule, ...] = (
    retraction_storm,  # only where the planner's twin does not model the engine (vLLM)
    activations_fit,  # before memory_low: a smaller chunk keeps the KV pool, and lowers memory_low's floor
    memory_low,
    memory_headroom,
    pacing_too_timid,
)
RULES: tuple[Rule, ...] = ON_DEATH + SAFETY_NET_SERVING
# what a start-up line alone decides, read before a launch on a forecast of that line
START_UP: tuple[Rule, ...] = (activations_fit, memory_low, memory_headroom)
# what is read before a launch: the start-up rules, then the graphs (a running worker's are the planner's)
LAUNCH: tuple[Rule, ...] = (*START_UP, graphs_cover)
LAUNCH_STEPS = 20  # moves at most before a launch (the memory band's floor steps the fraction one step at a time)


def before_launch(
    worker_id: str,
    args: Mapping[str, object],
    forecast: Callable[[Mapping[str, object]], Sequence[LogEvent]],
    s: RuleSettings,
    now: float,
    resolved: Callable[[Mapping[str, object]], Mapping[str, float]] | None = None,
) -> tuple[Decision, ...]:
    """The launch rules (:data:`LAUNCH`) read on ``forecast(args)``, the events a model of the
    worker says its start-up line would be, before the worker is launched: each decision's new
    arguments are the next forecast's, until no rule moves, a move would undo an earlier one (the
    forecast disagrees with itself: the worker's own line will say), or :data:`LAUNCH_STEPS`. The
    last decision's ``new_args`` are the ones to launch with (no decision: ``args``). A forecast
    without a start-up line says nothing. ``resolved``: what the model says the engine would choose for
    unset arguments its line does not print (the memory fraction), as the worker's server info says."""
    decisions: list[Decision] = []
    current = dict(args)
    ways: dict[str, int] = {}  # each moved knob: which way
    for _ in range(LAUNCH_STEPS):
        window = Window(span_s=s.constants.window_s).push_all(replace(e, time=now) for e in forecast(current))
        if window.startup is None:
            break
        state = ControlState.initial(worker_id, current)
        if resolved is not None:
            state = state.with_resolved(resolved(current))
        decision = evaluate(window, state, s, LAUNCH).decision
        if decision is None or decision.action is not Action.RESTART or decision.knob is None:
            break
        if ways.setdefault(decision.knob, decision.direction) != decision.direction:
            break
        decisions.append(decision)
        current = dict(decision.new_args)
    return tuple(decisions)


# -- gate and evaluation ------------------------------------------------------------------------


def gate(decision: Decision, state: ControlState, s: RuleSettings, now: float) -> str | None:
    """Why ``decision`` may not be acted on now (cool-down, budget, flip guard), or None."""
    if decision.action is Action.NOTE or decision.kind is RuleKind.SAFETY:
        return None
    c = s.constants
    if state.last_restart is not None and now - state.last_restart < c.cooldown_s:
        return f"cool-down: {c.cooldown_s - (now - state.last_restart):.1f} s left after the last restart"
    used = state.restarts_within(now)
    if used >= s.control.restarts_per_hour:
        return f"restart budget spent: {used} restarts in the last hour (limit {s.control.restarts_per_hour})"
    if decision.knob is not None and decision.direction:
        until = state.blocked_until(decision.knob, decision.direction)
        if until is not None and until > now:
            return f"flip guard: {decision.knob} was moved back {c.flip_guard_s - (until - now):.0f} s ago; held {until - now:.0f} s more"
        previous = state.moves.get(decision.knob)
        if (
            decision.kind is RuleKind.TUNING
            and previous is not None
            and previous.direction == -decision.direction
            and now - previous.time < c.flip_guard_s
        ):
            way = "raised" if previous.direction > 0 else "lowered"
            return f"flip guard: {decision.knob} was {way} by {previous.rule} {now - previous.time:.0f} s ago"
    return None


@dataclass(frozen=True, slots=True)
class Evaluation:
    decision: Decision | None  # the first decision the gate admitted
    refused: tuple[tuple[Decision, str], ...] = ()  # decisions held back, with the reason


def evaluate(
    window: Window, state: ControlState, settings: RuleSettings, rules: tuple[Rule, ...] = RULES
) -> Evaluation:
    refused: list[tuple[Decision, str]] = []
    for rule in rules:
        decision = rule(window, state, settings)
        if decision is None:
            continue
        why = gate(decision, state, settings, window.now)
        if why is None:
            return Evaluation(decision, tuple(refused))
        refused.append((decision, why))
    return Evaluation(None, tuple(refused))


def revive_delay(state: ControlState, c: Constants, now: float) -> float:
    """Back-off before reviving a worker that died: grows with its deaths in the crash-loop window."""
    deaths = max(state.deaths_within(now, c.crash_loop_window_s), 1)
    return c.crash_backoff_s[min(deaths, len(c.crash_backoff_s)) - 1]
