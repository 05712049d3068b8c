"""The candidate arguments a plan replays, and the replays of one look.

:func:`candidates` moves each argument the planner tunes one bounded step around the current ones;
:func:`band_fraction` adds the memory fraction that leaves the middle of the policy's free-memory band
free; :func:`roomier_pool` gives a chosen candidate the largest KV pool the band's floor allows.
:func:`replay_candidates` replays the newest requests under the current arguments and each candidate,
setting aside those outside the memory band: the figures the verdict chooses among.
:func:`lever_candidates` adds the guide's schedule policy and CUDA-graph batch size where the engine
has them. :func:`args_key` names a candidate alike on every look, so that its gains can be averaged over looks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.control.activations import ACTIVATION_MARGIN, covering_graphs
from proxy.control.economics import PlanSettings
from proxy.control.twin import TWIN_NAMES, ArgNames, Prediction, Twin
from proxy.control.workload import InFlight, Observed, Replay, continued, replay
from proxy.engines.base import KnobName
from proxy.sim.config import SimConfigError
from proxy.sim.twin import graph_max_bs, memory_fraction, prefill_chunk, queue_order, running_cap

__all__ = [
    "Replayed",
    "args_key",
    "band_fraction",
    "candidates",
    "free_floor_gb",
    "graphs_follow_cap",
    "lever_candidates",
    "newest_sample",
    "replay_candidates",
    "roomier_pool",
]


def args_key(args: Mapping[str, object]) -> str:
    """One candidate's arguments as a key that is the same on every look under the same args."""
    return ",".join(f"{name}={value!r}" for name, value in sorted(args.items()))


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def candidates(
    args: Mapping[str, object], resolved: Mapping[str, float], settings: PlanSettings, names: ArgNames = TWIN_NAMES
) -> list[dict[str, object]]:
    """Bounded candidate args around ``args`` (``resolved``: what the engine chose for unset ones),
    ``names``: the engine's names of the arguments moved."""

    def current(arg: str) -> float | None:
        value = _num(args.get(arg))
        return value if value is not None else resolved.get(arg)

    out: list[dict[str, object]] = []
    cons = current(names.conservativeness) or 1.0
    lo, hi = settings.conservativeness_bounds
    for value in settings.conservativeness:
        if lo <= value <= hi and abs(value - cons) > 1e-9:
            out.append({**args, names.conservativeness: value})
    running = current(names.max_running)
    if running:
        for value in (int(running * 0.5), int(running * 2)):
            if value >= 1:
                out.append({**args, names.max_running: value})
    chunk = current(names.prefill_chunk)
    if chunk and chunk > 0:
        for value in (int(chunk // 2), int(chunk * 2)):
            if 512 <= value <= 16384:
                out.append({**args, names.prefill_chunk: value})
    frac = current(names.memory_fraction)
    if frac:
        flo, fhi = settings.memory_fraction_bounds
        for value in (frac - settings.memory_fraction_step, frac + settings.memory_fraction_step):
            if flo <= value <= fhi:
                out.append({**args, names.memory_fraction: round(value, 3)})
    return out[: settings.max_candidates]


@dataclass(frozen=True, slots=True)
class Replayed:
    """The current args and the candidates replayed on one look."""

    sample: list[Observed]
    loaded: Replay
    seen: Prediction  # the current args on the window as it went
    current: Prediction  # the current args going on
    served: list[Prediction]  # the candidates inside the band that did not die
    refused: tuple[Prediction, ...]  # those outside the memory band
    replays: int


def replay_candidates(
    twin: Twin,
    args: Mapping[str, object],
    workload: Sequence[Observed],
    settings: PlanSettings,
    resolved: Mapping[str, float] | None,
    in_flight: Sequence[InFlight],
    now: float | None,
) -> Replayed:
    sample = newest_sample(workload, settings)
    window = replay(sample, workload, in_flight, now)
    loaded = continued(window, settings.horizon_s)
    seen = twin.predict(args, window)  # the window as it went: what the twin is judged on against the worker
    # the current args going on, with the window's own figures (the output answered in it, its answer times)
    current = replace(twin.predict(args, loaded), answered_tok_per_s=seen.answered_tok_per_s)
    refused: list[Prediction] = []
    served: list[Prediction] = []
    replays = 2
    in_band = band_fraction(twin, args, settings)
    # the engine's cached tokens say what its requests share; not reported (SGLang without
    # --enable-cache-report), the replay shows no sharing whatever there is, and lpm is not weighed at all
    reported = any(o.cached_tokens is not None for o in sample)
    levers = (
        lever_candidates(twin, args, loaded, current.peak_running, reported, settings.graph_max_bs_bounds)
        if settings.levers
        else []
    )
    moves = [graphs_follow_cap(twin, args, c, settings) for c in candidates(args, resolved or {}, settings, twin.names)]
    peers = [dict(settings.peer.args)] if settings.peer is not None else []
    for cand in ([in_band] if in_band is not None else []) + moves + levers + peers:
        p = twin.predict(cand, loaded)
        replays += 1
        if p.available_gpu_mem_gb is not None and p.available_gpu_mem_gb < free_floor_gb(twin, cand, settings):
            refused.append(p)
            continue
        if p.oom is None:
            served.append(p)
    return Replayed(sample, loaded, seen, current, served, tuple(refused), replays)


def lever_candidates(
    twin: Twin,
    args: Mapping[str, object],
    loaded: Replay,
    peak_running: int,
    sharing_known: bool = True,
    graph_bounds: tuple[float, float] = (1.0, float("inf")),
) -> list[dict[str, object]]:
    """The tuning guide's schedule policy and CUDA-graph batch size, where the twin's engine has them:
    the policy the other way (``lpm`` to ``fcfs``; ``fcfs`` to ``lpm`` only where the replay carries
    prefix sharing, which is all lpm works on), and the graphs' largest batch at the ladder's rung that
    covers ``peak_running`` (the largest batch the current args ran in the replay) where it outgrew
    them (its memory comes out of the KV pool where the memory fraction is SGLang's default, else out
    of the free memory; the twin prices both). Fewer graphs than the batch needs is a memory move the
    memory-fraction candidates make without slowing a decode step, so none is proposed.
    ``sharing_known`` False (the engine does not report its cached tokens): no policy candidate;
    ``graph_bounds``: the range the graphs' batch size may move in (the policy's bounds)."""
    names = twin.names
    try:
        cfg = twin.config(args)
    except SimConfigError:
        return []
    out: list[dict[str, object]] = []
    order = twin.engine.knobs.get(KnobName.QUEUE_ORDER)
    if names.queue_order is not None and order is not None and sharing_known:
        by_prefix, by_arrival = order.choices  # the knob's two orders (its table says which is which)
        policy = queue_order(cfg)
        if policy == by_prefix:
            out.append({**args, names.queue_order: by_arrival})
        elif policy == by_arrival and any(sp.shared for sp in loaded.specs):
            out.append({**args, names.queue_order: by_prefix})
    knob = twin.engine.knobs.get(KnobName.GRAPH_MAX_BS)
    now = graph_max_bs(cfg)
    if names.graph_max_bs is not None and knob is not None and now > 0 and peak_running > now:
        rungs = [rung for rung in knob.ladder if graph_bounds[0] <= rung <= graph_bounds[1]] or [now]
        up = next((rung for rung in rungs if rung >= peak_running), rungs[-1])
        if up > now:
            out.append({**args, names.graph_max_bs: int(up)})
    return out


def graphs_follow_cap(
    twin: Twin, args: Mapping[str, object], cand: dict[str, object], settings: PlanSettings
) -> dict[str, object]:
    """``cand`` with CUDA graphs that follow a raised running cap, where ``args``' graphs cover the
    current cap as far as the launch sized them (:func:`~proxy.control.activations.covering_graphs`): they
    are derived from the cap, so a new cap re-derives them. In the fleet scenario w3's plan raised its
    cap 64 -> 128 with the graphs left at 64, and every batch past 64 decoded without them."""
    names, knob = twin.names, twin.engine.knobs.get(KnobName.GRAPH_MAX_BS)
    if names.graph_max_bs is None or knob is None:
        return cand
    try:
        old_cap, new_cap = running_cap(twin.config(args)), running_cap(twin.config(cand))
    except SimConfigError:
        return cand
    if new_cap <= old_cap:
        return cand
    now, new = twin.activations(args), twin.activations(cand)
    if now is None or new is None or now.graph_max_bs <= 0:
        return cand
    upper = settings.graph_max_bs_bounds[1]
    if now.graph_max_bs < covering_graphs(now, knob.ladder, old_cap, upper):
        return cand  # the graphs are not the cap's (a person's, or the engine's default)
    size = covering_graphs(new, knob.ladder, new_cap, upper)
    return {**cand, names.graph_max_bs: size} if size > now.graph_max_bs else cand


def free_floor_gb(twin: Twin, args: Mapping[str, object], settings: PlanSettings, peak_running: int = 0) -> float:
    """The least free memory at start-up a candidate may leave: :data:`ACTIVATION_MARGIN` x the twin's
    activations for a full prefill chunk and for a decode batch of ``peak_running`` past the CUDA graphs,
    and the activations of the candidate's whole running cap past them (what ``activations_fit`` checks
    on the start-up line: less, and the safety net restarts the worker again at once); where the twin's
    model is not known to be the worker's (``settings.activations_known``), at least the band's floor."""
    act = twin.activations(args)
    if act is None:
        return settings.min_available_gb
    try:
        cfg = twin.config(args)
    except SimConfigError:
        return settings.min_available_gb
    derived = max(
        act.free_floor_gb(prefill_chunk(cfg) or cfg.max_prefill_tokens),
        ACTIVATION_MARGIN * act.decode_gb(peak_running),
        act.decode_gb(running_cap(cfg)),  # as activations_fit counts it
    )
    return derived if settings.activations_known else max(settings.min_available_gb, derived)


def roomier_pool(twin: Twin, chosen: Prediction, loaded: Replay, settings: PlanSettings) -> Prediction | None:
    """``chosen`` (a candidate a restart is paid for) with the largest memory fraction whose free
    memory at start-up stays at the floor of the policy's band or above, and at ``ACTIVATION_MARGIN``
    x the activations the twin gives for a full prefill chunk and for the replay's largest decode
    batch past the CUDA graphs (the twin's memory model, on the grid of ``memory_fraction_step``'s
    multiples within the bounds), replayed: a larger KV pool the restart takes for free. The one-step
    memory candidates alone rarely pay a restart of their own (0.01 is 1-2 % more pool), so a
    fraction the band allows was left unused behind every other move. The margin: the twin's
    activations are presets, not measured (the perturbed premises' engine needs 25 % more), and a
    pool that leaves only what they say free dies on the first long prompt.
    None: no larger fraction keeps that free, or the twin would not start with it."""
    args = chosen.args
    try:
        now = twin.config(args)
    except SimConfigError:
        return None
    keep_gb = free_floor_gb(twin, args, settings, chosen.peak_running)
    step = settings.memory_fraction_step
    current = memory_fraction(now)
    _, top = settings.memory_fraction_bounds
    room: float | None = None
    frac = round((math.floor(current / step + 1e-9) + 1) * step, 3)  # the grid's next value above the current
    while frac <= top + 1e-9:
        try:
            free = twin.config({**args, twin.names.memory_fraction: frac}).memory.available_gb
        except SimConfigError:
            break
        if free < keep_gb:
            break
        room = frac
        frac = round(frac + step, 3)
    if room is None:
        return None
    p = twin.predict({**args, twin.names.memory_fraction: room}, loaded)
    if p.oom is not None or (p.available_gpu_mem_gb is not None and p.available_gpu_mem_gb < keep_gb):
        return None
    return p


def band_fraction(twin: Twin, args: Mapping[str, object], settings: PlanSettings) -> dict[str, object] | None:
    """The candidate whose memory fraction leaves the middle of the free-memory band free at start-up
    (the twin's own memory model, on a grid of 0.01 within the bounds): one step to where the band
    says the pool belongs, where the one-step candidates would take many restarts to get there.
    None: no band top, the current args already inside the band, or no fraction lands in it."""
    if settings.max_available_gb is None:
        return None
    try:
        now_free = twin.config(args).memory.available_gb
    except SimConfigError:
        return None
    low = free_floor_gb(twin, args, settings)
    high = max(settings.max_available_gb, low)
    if low <= now_free <= high:
        return None
    middle = (low + high) / 2
    flo, fhi = settings.memory_fraction_bounds
    best: tuple[float, float] | None = None  # (distance from the middle, fraction)
    for step in range(round(flo * 100), round(fhi * 100) + 1):
        frac = step / 100
        try:
            free = twin.config({**args, twin.names.memory_fraction: frac}).memory.available_gb
        except SimConfigError:
            continue
        if low <= free <= high and (best is None or abs(free - middle) < best[0]):
            best = (abs(free - middle), frac)
    return None if best is None else {**args, twin.names.memory_fraction: best[1]}


def newest_sample(workload: Sequence[Observed], settings: PlanSettings) -> list[Observed]:
    return sorted(workload, key=lambda o: o.arrived)[-settings.max_requests :]
