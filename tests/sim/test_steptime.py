"""The step-time model and its calibration against the tuning guide's log line."""

from __future__ import annotations

import re

import pytest

from proxy.sim.request import RequestSpec
from proxy.sim.steptime import graph_batch_sizes, startup_seconds
from proxy.sim.virtual import simulate
from tests.sim.helpers import config

GUIDE_RUNNING, GUIDE_TOKENS, GUIDE_THROUGHPUT = 233, 370959, 4594.01


def test_decode_step_at_the_guides_line() -> None:
    model = config().step_model()
    t = model.decode_seconds(GUIDE_RUNNING, GUIDE_TOKENS, cuda_graph=True)
    assert GUIDE_RUNNING / t == pytest.approx(GUIDE_THROUGHPUT, rel=0.10)


def test_steady_state_gen_throughput_lands_near_the_guide() -> None:
    logs: list[str] = []
    wl = [RequestSpec(prompt_len=800, max_new_tokens=1600) for _ in range(1200)]
    simulate(config(), wl, log=lambda level, msg: logs.append(msg))
    pat = re.compile(
        r"#running-req: (\d+), #token: (\d+), token usage: ([\d.]+), .*gen throughput \(token/s\): ([\d.]+)"
    )
    rows = [tuple(float(x) for x in m.groups()) for m in map(pat.search, logs) if m]
    busy = [r for r in rows if 200 <= r[0] <= 260 and r[2] >= 0.75]
    assert len(busy) >= 10
    mean = sum(r[3] for r in busy) / len(busy)
    assert mean == pytest.approx(GUIDE_THROUGHPUT, rel=0.15)


def test_decode_slower_without_cuda_graph_and_with_more_kv() -> None:
    m = config().step_model()
    assert m.decode_seconds(64, 10000, cuda_graph=False) > m.decode_seconds(64, 10000, cuda_graph=True)
    assert m.decode_seconds(64, 200000, cuda_graph=True) > m.decode_seconds(64, 10000, cuda_graph=True)


def test_prefill_compute_bound_and_faster_gpu_is_faster() -> None:
    h100, a100 = config().step_model(), config("--sim-gpu", "a100-80gb").step_model()
    assert h100.prefill_seconds(8192, 0, 1) > 4 * h100.prefill_seconds(1024, 0, 1) / 4
    assert a100.prefill_seconds(8192, 0, 1) > h100.prefill_seconds(8192, 0, 1)
    assert h100.prefill_seconds(8192, 8192 * 30000, 1) > h100.prefill_seconds(8192, 0, 1)


def test_graphs_beyond_their_batch_size_run_eager() -> None:
    logs: list[str] = []
    cfg = config("--cuda-graph-max-bs-decode", "16", "--decode-log-interval", "1")
    simulate(cfg, [RequestSpec(prompt_len=50, max_new_tokens=20) for _ in range(40)], log=lambda lv, m: logs.append(m))
    decode = [m for m in logs if m.startswith("Decode batch")]
    assert any("#running-req: 40," in m and "cuda graph: False" in m for m in decode)
    assert config("--disable-cuda-graph").cuda_graph_max_bs_decode == 0


def test_startup_costs_what_a_real_start_costs() -> None:
    cfg = config()
    load, capture, total = startup_seconds(cfg.weights_bytes, cfg.cuda_graph_max_bs_decode)
    assert load == pytest.approx(16.06e9 / 2e9)
    assert capture == pytest.approx(len(graph_batch_sizes(256)) * 0.1)
    assert 15 < total < 60
    assert cfg.startup_wall_seconds == pytest.approx(total)
    assert config("--sim-time-scale", "10").startup_wall_seconds == pytest.approx(total / 10)
    assert config("--sim-startup-seconds", "0.2").startup_wall_seconds == 0.2


def test_start_up_counts_the_process_own_start() -> None:
    """The modelled start-up includes the interpreter and imports: the process's age is taken off it."""
    from proxy.sim.startup import process_age_s

    age = process_age_s()
    assert 0.0 < age < 3600.0  # this test process started a while ago, not at boot
