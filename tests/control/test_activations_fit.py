"""The crash the twin's activations foresee (``activations_fit``): the start-up line a simulated SGLang
worker prints, read by SGLang's log follower, against the activations of the planner's twin of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import pytest

from proxy.control.activations import Activations, decode_split_mib
from proxy.control.constants import CONSTANTS
from proxy.control.decision import ControlState, RuleKind
from proxy.control.planner import Twin
from proxy.control.rules import (
    SAFETY_NET_SERVING,
    RuleSettings,
    activations_fit,
    before_launch,
    graphs_cover,
    memory_low,
)
from proxy.control.window import Window
from proxy.engines.base import EventKind, LogEvent
from proxy.engines.sglang.knobs import KNOBS
from proxy.engines.sglang.logs import LogFollower
from proxy.policy import ControlMode, ControlSettings
from proxy.sim.twin import graph_max_bs
from proxy.workers.base import WorkerState

from .test_controller import controller, info


def _started(gpu: str, model: str, args: Mapping[str, object]) -> Window:
    """The window after the start-up line the simulator prints for ``args`` on ``gpu``."""
    return Window(span_s=60.0).push_all(LogFollower().feed(_startup_text(gpu, model, args), 1.0))


def _startup_text(gpu: str, model: str, args: Mapping[str, object]) -> str:
    """The start-up line the simulator prints for ``args`` on ``gpu`` (the twin's forecast is that line)."""
    line = Twin(gpu, model).startup_line(args)
    assert line is not None
    return line


BAND = replace(CONSTANTS, available_mem_band_gb=(2.0, 10.0))


def _settings(gpu: str, model: str) -> RuleSettings:
    twin = Twin(gpu, model)
    return RuleSettings(control=ControlSettings(), knobs=KNOBS, activations=twin.activations)


def _state(args: Mapping[str, object]) -> ControlState:
    return ControlState.initial("w0", dict(args))


def test_a_prefill_chunk_whose_activations_do_not_fit_steps_down_before_the_crash() -> None:
    """chunked_prefill_size 16384 with mem_fraction_static 0.9 on a 48 GB L40S: a full chunk needs 4 GB
    of activations, 3.94 GB are free. The highest rung below that fits is 8192 (2 GB)."""
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    d = activations_fit(
        _started("l40s-48gb", "llama-3.1-8b", args), _state(args), _settings("l40s-48gb", "llama-3.1-8b")
    )
    assert d is not None and d.rule == "activations_fit" and d.kind is RuleKind.CORRECTIVE
    assert d.changes == {"chunked_prefill_size": (16384, 8192)}
    ev = d.evidence_json()
    assert ev["need_gb"] == 4.0 and ev["available_gpu_mem_gb"] == pytest.approx(3.94, abs=0.01)
    assert ev["tokens"] == 16384 and ev["model"] == "llama-3.1-8b on l40s-48gb" and "batch" not in ev
    assert "needs 4.00 GB of activations" in d.reason
    smaller = {
        "chunked_prefill_size": 8192,
        "mem_fraction_static": 0.93,
    }  # 2 GB in 2.59 free: fits, and 2048 x 1.25 MiB too
    assert activations_fit(_started("l40s-48gb", "llama-3.1-8b", smaller), _state(smaller),
                           _settings("l40s-48gb", "llama-3.1-8b")) is None  # fmt: skip


def test_a_decode_batch_that_does_not_fit_takes_memory_from_the_pool_and_from_the_cap_alike() -> None:
    """max_running_requests 2048 on a 24 GB RTX 4090 at mem_fraction_static 0.93: past the CUDA graphs
    (48) a decode batch needs 1.1 MiB per request, 2.2 GB for the cap, and 1.09 GB are free. The
    shortfall is shared so that the pool loses the same share of itself as the cap: the fraction comes
    down to 0.888 and the cap to the batch the memory then free holds, measured at the worst the next
    line may print; that line finds nothing to move."""
    args = {"max_running_requests": 2048, "mem_fraction_static": 0.93}
    window = _started("rtx4090-24gb", "llama-3.2-1b", args)
    settings = _settings("rtx4090-24gb", "llama-3.2-1b")
    d = activations_fit(window, _state(args), settings)
    assert d is not None and d.rule == "activations_fit"
    assert d.changes == {"max_running_requests": (2048, 1943), "mem_fraction_static": (0.93, 0.888)}
    assert d.knob == "memory_fraction" and d.evidence_json()["batch"] == 2048
    twin = Twin("rtx4090-24gb", "llama-3.2-1b")
    before, after = twin.config(args).memory, twin.config(d.new_args).memory
    pool_loss = 1 - after.kv_pool_mib / before.kv_pool_mib
    cap_loss = 1 - 1943 / 2048
    assert pool_loss == pytest.approx(cap_loss, abs=0.01)  # neither side pays alone
    assert after.available_mib - 0.005 * 1024 >= 1943 * 1.1  # fits what the next line may print at worst
    assert activations_fit(_started("rtx4090-24gb", "llama-3.2-1b", d.new_args), _state(d.new_args), settings) is None


def test_the_split_is_zero_where_the_batch_fits_and_grows_with_the_pool() -> None:
    assert decode_split_mib(free_mib=2000.0, need_mib=1500.0, pool_mib=20_000.0) == 0.0
    small, large = (decode_split_mib(free_mib=600.0, need_mib=2200.0, pool_mib=p) for p in (2_000.0, 20_000.0))
    assert 0 < small < large < 1600.0  # a small pool gives less; never the whole shortfall
    assert large / 20_000.0 == pytest.approx(1 - (600.0 + large) / 2200.0)


def test_with_the_fraction_at_its_floor_the_cap_comes_down_to_the_batch_that_fits() -> None:
    """The same worker where the policy keeps mem_fraction_static at 0.93 or above: the cap alone comes
    down, to the ~1010 requests whose decode activations fit the 1.09 GB the line reports."""
    args = {"max_running_requests": 2048, "mem_fraction_static": 0.93}
    window = _started("rtx4090-24gb", "llama-3.2-1b", args)
    control = ControlSettings(bounds={"mem_fraction_static": (0.93, 0.95)})
    settings = replace(_settings("rtx4090-24gb", "llama-3.2-1b"), control=control)
    d = activations_fit(window, _state(args), settings)
    assert d is not None and d.changes is not None and list(d.changes) == ["max_running_requests"]
    old, new = d.changes["max_running_requests"]
    free_mib = Twin("rtx4090-24gb", "llama-3.2-1b").config(args).memory.available_mib
    # the line prints 1.09 GB for 1.0855: sized to the true figure, not the printed one (1014 would die)
    assert old == 2048 and (new + 1) * 1.1 > free_mib - 0.005 * 1024 and new * 1.1 <= free_mib
    assert 1000 < new <= 1010
    assert d.evidence_json()["batch"] == 2048 and d.evidence_json()["graph_max_bs"] == 48


def test_a_model_that_is_not_this_worker_is_not_used() -> None:
    """The same start-up line read with the twin of another model (its KV pool is not the one the
    worker reported): no forecast; and without the planner's twin the rule says nothing."""
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    window = _started("l40s-48gb", "llama-3.1-8b", args)
    assert activations_fit(window, _state(args), _settings("l40s-48gb", "qwen2.5-7b")) is None
    assert activations_fit(window, _state(args), RuleSettings(control=ControlSettings(), knobs=KNOBS)) is None
    off = Activations(prefill_mib_per_token=0.25, decode_mib_per_seq=1.25, graph_max_bs=32, pool_tokens=150_000,
                      model="x")  # fmt: skip
    assert activations_fit(window, _state(args), replace(_settings("l40s-48gb", "llama-3.1-8b"),
                                                         activations=lambda _: off)) is None  # fmt: skip


def test_the_forecast_is_in_the_safety_net() -> None:
    assert activations_fit in SAFETY_NET_SERVING


@pytest.mark.parametrize(("mode", "twin_gpu", "held"), [(ControlMode.AUTO, "l40s-48gb", True),
                                                        (ControlMode.ADVISE, "l40s-48gb", False),
                                                        (ControlMode.AUTO, "h100-80gb", False)])  # fmt: skip
def test_a_starting_worker_whose_start_up_line_foresees_the_crash_comes_up_held(mode, twin_gpu, held) -> None:
    """The forecast is read from the start-up line while the worker starts: under ``auto`` the worker
    is held (it comes up DRAINING: no request reaches the arguments that would crash), and once up the
    first tick restarts it with the chunk that fits. Advising, or with a twin of another GPU (its KV
    pool is not the one the worker reported), the worker comes up as it is."""
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    holds: list[str] = []
    c, clock = controller(mode, None, hold=holds.append, available_mem_band_gb=(2.0, 10.0), twin_gpu=twin_gpu)
    c.track(info(state=WorkerState.STARTING, args=args))
    c.on_line("w0", _startup_text("l40s-48gb", "llama-3.1-8b", args))
    assert holds == (["w0"] if held else [])
    clock.now = 2.0
    c.track(info(state=WorkerState.DRAINING if held else WorkerState.READY, args=args))
    acts = c.tick()
    if held:
        (act,) = acts
        assert act.decision.rule == "activations_fit"
        assert act.decision.changes == {"chunked_prefill_size": (16384, 8192)}
    else:
        assert [a.decision.rule for a in acts] == []


# -- the same rules read before the launch, on the twin's forecast of the start-up line ---------------


def _forecast(gpu: str, model: str) -> Callable[[Mapping[str, object]], list[LogEvent]]:
    def forecast(args: Mapping[str, object]) -> list[LogEvent]:
        return LogFollower().feed(_startup_text(gpu, model, args), 0.0)

    return forecast


def test_before_the_launch_the_chunk_that_would_crash_is_lowered_on_the_forecast() -> None:
    """prefill-oom's arguments (chunk 16384, fraction 0.9 on a 48 GB L40S): the forecast line says 3.94
    GB free, a full chunk needs 4 GB; one move to 8192, and at 8192 nothing else moves: with the shipped
    constants, 3.94 GB is above what a chunk of 8192 needs with margin (1.5 x 2 GB), though below the
    band's floor (5 GB), which holds only where the twin's model is not the worker's."""
    settings = _settings("l40s-48gb", "llama-3.1-8b")
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    d, graphs = before_launch("w0", args, _forecast("l40s-48gb", "llama-3.1-8b"), settings, 5.0)
    assert d.rule == "activations_fit" and d.changes == {"chunked_prefill_size": (16384, 8192)} and d.time == 5.0
    assert d.new_args == {**args, "chunked_prefill_size": 8192}
    assert graphs.rule == "graphs_cover" and graphs.changes == {"cuda_graph_max_bs_decode": (None, 256)}


def test_the_free_memory_floor_is_the_chunks_activations_with_margin_where_the_model_is_the_workers() -> None:
    """On a 48 GB L40S with chunks of 8192 (2 GB of activations): 2.59 GB free at 0.93 is below 1.5 x 2 GB,
    one step down; 3.04 GB at 0.92 is not. A start-up line whose KV pool is not the twin's (another
    model) falls back on the band's floor, 5 GB."""
    settings = _settings("l40s-48gb", "llama-3.1-8b")
    tight = {"chunked_prefill_size": 8192, "mem_fraction_static": 0.93}
    d = memory_low(_started("l40s-48gb", "llama-3.1-8b", tight), _state(tight), settings)
    assert d is not None and d.changes == {"mem_fraction_static": (0.93, 0.92)}
    assert "2.59 GB free at start-up (< 3 GB)" in d.reason
    roomy = {"chunked_prefill_size": 8192, "mem_fraction_static": 0.92}
    assert memory_low(_started("l40s-48gb", "llama-3.1-8b", roomy), _state(roomy), settings) is None
    other = {"chunked_prefill_size": 8192, "mem_fraction_static": 0.92}
    elsewhere = Window(span_s=60.0).push_all(
        [LogEvent(kind=EventKind.STARTUP, time=1.0, fields={"available_gpu_mem_gb": 3.04, "max_total_tokens": 50_000})]
    )
    d = memory_low(elsewhere, _state(other), settings)
    assert d is not None and "(< 5 GB)" in d.reason


def test_before_the_launch_idle_memory_is_sized_into_the_band() -> None:
    """mem_fraction_static 0.6 on an 80 GB H100 leaves ~30 GB free: the band's top is 10, so the
    fraction is raised once to what leaves the band's middle free, and the forecast at the new
    fraction lies inside the band."""
    settings = replace(_settings("h100-80gb", "llama-3.1-8b"), constants=BAND)
    d, graphs = before_launch("w0", {"mem_fraction_static": 0.6}, _forecast("h100-80gb", "llama-3.1-8b"), settings, 0.0)
    assert d.rule == "memory_headroom" and 0.85 < float(d.new_args["mem_fraction_static"]) < 0.95
    free = Twin("h100-80gb", "llama-3.1-8b").config(d.new_args).memory.available_gb
    assert 2.0 <= free <= 10.0
    assert (
        graphs.rule == "graphs_cover"
        and Twin("h100-80gb", "llama-3.1-8b").config(graphs.new_args).memory.available_gb >= 2.0
    )


def test_before_the_launch_an_unset_memory_fraction_is_read_from_the_twin() -> None:
    """A 1B model on an H200 with no memory fraction set: SGLang's default leaves 12.06 GB free. The
    start-up line does not print the fraction, so the forecast reads the one the twin's engine resolves
    (as a worker's server info would): raised before the launch, not by a restart after it."""
    twin = Twin("h200-141gb", "llama-3.2-1b")
    settings = _settings("h200-141gb", "llama-3.2-1b")
    args = {"schedule_policy": "lpm"}
    forecast = _forecast("h200-141gb", "llama-3.2-1b")
    # the fraction unknown: it does not move (the graphs do: their rule reads the pool, not the fraction)
    assert [d.rule for d in before_launch("w0", args, forecast, settings, 0.0)] == ["graphs_cover"]
    d, _graphs = before_launch("w0", args, forecast, settings, 0.0, twin.resolved)
    assert d.rule == "memory_headroom" and d.changes == {"mem_fraction_static": (None, 0.942)}
    assert "raise mem_fraction_static 0.907 -> 0.942" in d.reason
    assert 5.0 <= twin.config(d.new_args).memory.available_gb <= 10.0


def _line(free_gb: float) -> LogEvent:
    return LogEvent(
        kind=EventKind.STARTUP, time=0.0, fields={"available_gpu_mem_gb": free_gb, "max_total_tokens": 100_000}
    )


def test_before_the_launch_a_move_that_would_undo_one_ends_the_moves() -> None:
    """A forecast whose free memory jumps across the band between two fractions: the floor lowers the
    fraction, the top would raise it back; a move that undoes one ends the moves at the one before it."""
    settings = RuleSettings(control=ControlSettings(), knobs=KNOBS, constants=BAND)

    def forecast(args: Mapping[str, object]) -> list[LogEvent]:
        return [_line(1.0 if float(args["mem_fraction_static"]) >= 0.9 else 20.0)]  # type: ignore[arg-type]

    moves = before_launch("w0", {"mem_fraction_static": 0.9}, forecast, settings, 0.0)
    assert [d.rule for d in moves] == ["memory_low"] and moves[0].new_args["mem_fraction_static"] == 0.89


def test_a_forecast_without_a_start_up_line_moves_nothing() -> None:
    settings = RuleSettings(control=ControlSettings(), knobs=KNOBS)
    assert before_launch("w0", {"mem_fraction_static": 0.6}, lambda args: [], settings, 0.0) == ()


L40S_BYTES = 46068 * 2**20  # NVML's total memory of an L40S


@pytest.mark.parametrize(
    ("mode", "args", "total", "launched"),
    [
        # a simulated worker: the twin is its own presets, NVML is not asked
        (ControlMode.AUTO, {"sim_gpu": "l40s-48gb", "sim_model": "llama-3.1-8b"}, None, 8192),
        # a real worker on the policy's twin GPU, NVML's total says it is that GPU
        (ControlMode.AUTO, {}, L40S_BYTES, 8192),
        # ... a GPU of another size, or no NVML: the twin is not this GPU's, the worker starts as configured
        (ControlMode.AUTO, {}, 81559 * 2**20, 16384),
        (ControlMode.AUTO, {}, None, 16384),
        # advising: the move is journaled, the worker starts as configured
        (ControlMode.ADVISE, {"sim_gpu": "l40s-48gb", "sim_model": "llama-3.1-8b"}, None, 16384),
    ],
)
def test_a_first_launch_takes_the_forecasts_moves_where_the_twin_is_the_workers_gpu(
    mode, args, total, launched
) -> None:
    c, _ = controller(mode, None, available_mem_band_gb=(2.0, 10.0), twin_gpu="l40s-48gb")
    configured = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9, **args}
    out = c.launch_args("w0", configured, gpu_total_bytes=total)
    graphs = {"cuda_graph_max_bs_decode": 256} if launched == 8192 else {}  # raised after the chunk, in the same launch
    assert out == {**configured, "chunked_prefill_size": launched, **graphs}
    entries = c.journal.entries()
    if launched == 16384 and mode is ControlMode.AUTO:
        assert entries == []
        return
    entry, raised = entries
    assert entry["rule"] == "activations_fit" and entry["changes"] == {"chunked_prefill_size": [16384, 8192]}
    assert raised["rule"] == "graphs_cover" and raised["changes"] == {"cuda_graph_max_bs_decode": [None, 256]}
    assert entry["status"] == raised["status"] == ("applied" if mode is ControlMode.AUTO else "advised")
    assert entry["detail"].startswith("before its first launch, on the twin's forecast of its start-up line")


def test_no_forecast_when_the_controller_is_off() -> None:
    c, _ = controller(ControlMode.OFF, None)
    configured = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9, "sim_gpu": "l40s-48gb"}
    assert c.launch_args("w0", configured) == configured and c.journal.entries() == []


@pytest.mark.parametrize(
    ("gpu", "args", "raised"),
    [
        ("a100-40gb", {}, 160),  # SGLang's tier default covers 32; 2 % of the pool buys 174: the rung below
        ("a100-40gb", {"max_running_requests": 64}, 64),  # the cap itself: no graph past the largest batch it allows
        ("h200-141gb", {}, 1024),  # the knob's top rung
        ("a100-40gb", {"cuda_graph_max_bs_decode": 0}, None),  # graphs a person switched off stay off
        ("a100-40gb", {"cuda_graph_max_bs_decode": 256}, None),  # never lowered
    ],
)
def test_before_the_launch_the_cuda_graphs_cover_the_batches_the_pool_holds(gpu, args, raised) -> None:
    """The decode graphs are raised before a launch to cover the batches the running cap allows, within
    2 % of the KV pool's memory, never below the free-memory floor; a running worker's are the planner's."""
    twin = Twin(gpu, "llama-3.1-8b")
    settings = _settings(gpu, "llama-3.1-8b")
    moves = before_launch("w0", args, _forecast(gpu, "llama-3.1-8b"), settings, 0.0, twin.resolved)
    graphs = [d for d in moves if d.rule == "graphs_cover"]
    if raised is None:
        assert graphs == []
        return
    (d,) = graphs
    assert d.new_args["cuda_graph_max_bs_decode"] == raised and d.kind is RuleKind.TUNING
    cfg = twin.config(d.new_args)
    assert cfg.memory.graph_mib <= 0.02 * cfg.memory.kv_pool_mib + 1
    assert cfg.memory.available_gb >= Activations.free_floor_gb(twin.activations(d.new_args), 4096)
    # after the launch the worker's own start-up line restarts nothing for the graphs
    started = _started(gpu, "llama-3.1-8b", d.new_args)
    state = _state(d.new_args).with_resolved(twin.resolved(d.new_args))
    assert all(
        rule(started, state, settings) is None for rule in SAFETY_NET_SERVING if rule.__name__ != "pacing_too_timid"
    )


def test_before_the_launch_graphs_do_not_take_the_memory_the_capped_decode_batch_needs() -> None:
    """decode-oom's arguments (running cap 2048, fraction 0.93 on a 24 GB RTX 4090): the cap comes down to
    the decode batch the free memory holds past SGLang's 48 graphs, and the graphs stay at 48: raised,
    they would take the memory that batch needs. The worker launched with the result does not die of
    its largest batch (the simulator's own check)."""
    gpu, model = "rtx4090-24gb", "llama-3.2-1b"
    twin = Twin(gpu, model)
    args = {"max_running_requests": 2048, "mem_fraction_static": 0.93}
    moves = before_launch("w0", args, _forecast(gpu, model), _settings(gpu, model), 0.0, twin.resolved)
    assert [d.rule for d in moves] == ["activations_fit"]
    launched = moves[-1].new_args
    cfg = twin.config(launched)
    cap = int(launched["max_running_requests"])  # type: ignore[call-overload]
    assert cap > 1000 and cap * cfg.model.decode_act_mib_per_seq <= cfg.memory.available_mib
    assert graph_max_bs(cfg) == 48


def test_the_graphs_leave_the_free_memory_floor_where_memory_is_tight() -> None:
    """On a 48 GB L40S at fraction 0.92 with chunks of 8192 (3.04 GB free, the floor 3 GB): graphs to 256
    (2 % of the pool) would take memory a full chunk needs; they go one rung, to 48 (32 MiB more)."""
    settings = _settings("l40s-48gb", "llama-3.1-8b")
    tight = {"chunked_prefill_size": 8192, "mem_fraction_static": 0.92}
    d = graphs_cover(_started("l40s-48gb", "llama-3.1-8b", tight), _state(tight), settings)
    assert d is not None and d.changes == {"cuda_graph_max_bs_decode": (None, 48)}
    assert Twin("l40s-48gb", "llama-3.1-8b").config(d.new_args).memory.available_gb >= 3.0
    tighter = {"chunked_prefill_size": 8192, "mem_fraction_static": 0.921}
    assert graphs_cover(_started("l40s-48gb", "llama-3.1-8b", tighter), _state(tighter), settings) is None
