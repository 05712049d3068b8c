"""The crash the twin's activations foresee (``activations_fit``): the start-up line a simulated SGLang
worker prints, read by SGLang's log follower, against the activations of the planner's twin of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from proxy.control.decision import ControlState, RuleKind
from proxy.control.planner import Twin
from proxy.control.rules import SAFETY_NET_SERVING, WHILE_SERVING, Activations, RuleSettings, activations_fit
from proxy.control.window import Window
from proxy.engines.sglang.knobs import KNOBS
from proxy.engines.sglang.logs import LogFollower
from proxy.policy import ControlMode, ControlSettings
from proxy.sim.logs import startup_line
from proxy.workers.base import WorkerState

from .test_controller import controller, info


def _started(gpu: str, model: str, args: Mapping[str, object]) -> Window:
    """The window after the start-up line the simulator prints for ``args`` on ``gpu``."""
    cfg = Twin(gpu, model).config(args)
    line = startup_line(max_total_num_tokens=cfg.memory.max_total_num_tokens,
                        chunked_prefill_size=cfg.chunked_prefill_size or -1, max_prefill_tokens=cfg.max_prefill_tokens,
                        max_running_requests=cfg.max_running_requests, context_len=cfg.context_len,
                        available_gpu_mem_gb=cfg.memory.available_gb)  # fmt: skip
    return Window(span_s=60.0).push_all(LogFollower().feed(line, 1.0))


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


def test_a_running_cap_whose_decode_batch_does_not_fit_comes_down_to_the_batch_that_does() -> None:
    """max_running_requests 2048 on a 24 GB RTX 4090 at mem_fraction_static 0.93: past the CUDA graphs
    (48) a decode batch needs 1.1 MiB per request and 1.09 GB are free: about 1010 fit."""
    args = {"max_running_requests": 2048, "mem_fraction_static": 0.93}
    window = _started("rtx4090-24gb", "llama-3.2-1b", args)
    d = activations_fit(window, _state(args), _settings("rtx4090-24gb", "llama-3.2-1b"))
    assert d is not None and d.changes is not None
    old, new = d.changes["max_running_requests"]
    free_mib = Twin("rtx4090-24gb", "llama-3.2-1b").config(args).memory.available_mib
    assert old == 2048 and new == int(round(free_mib / 1024, 2) * 1024 / 1.1)  # the line prints GB to 2 places
    assert 1000 < new < 1020
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


def test_the_forecast_is_in_the_planners_safety_net_only() -> None:
    assert activations_fit in SAFETY_NET_SERVING and activations_fit not in WHILE_SERVING


def _startup_text(gpu: str, model: str, args: Mapping[str, object]) -> str:
    cfg = Twin(gpu, model).config(args)
    return startup_line(max_total_num_tokens=cfg.memory.max_total_num_tokens,
                        chunked_prefill_size=cfg.chunked_prefill_size or -1, max_prefill_tokens=cfg.max_prefill_tokens,
                        max_running_requests=cfg.max_running_requests, context_len=cfg.context_len,
                        available_gpu_mem_gb=cfg.memory.available_gb)  # fmt: skip


@pytest.mark.parametrize(("mode", "planner", "held"), [(ControlMode.AUTO, True, True), (ControlMode.ADVISE, True, False),
                                                       (ControlMode.AUTO, False, False)])  # fmt: skip
def test_a_starting_worker_whose_start_up_line_foresees_the_crash_comes_up_held(mode, planner, held) -> None:
    """The forecast is read from the start-up line while the worker starts: under ``auto`` with the
    planner the worker is held (it comes up DRAINING: no request reaches the arguments that would
    crash), and once up the first tick restarts it with the chunk that fits. Advising, or without the
    planner's twin, the worker comes up as it is."""
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9, "sim_gpu": "l40s-48gb",
            "sim_model": "llama-3.1-8b"}  # fmt: skip
    holds: list[str] = []
    c, clock = controller(mode, None, hold=holds.append, planner=planner, available_mem_band_gb=(2.0, 10.0))
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
