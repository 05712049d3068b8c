"""The forecast before a launch on a real engine's GPU: the proxy reads NVML (a recorded H100 80GB here,
through the real sampler), and a managed SGLang worker (the fake worker standing in for its process)
is launched with the moves the twin's forecast says its start-up line would call for, only where the
GPU NVML reports is the size of the policy's ``twin_gpu``."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.compose import build_app, serve
from proxy.control.constants import CONSTANTS
from proxy.observe.nvml import sample_with
from proxy.policy import parse_policy
from proxy.server.state import PROXY
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until
from tests.observe.test_nvml import _Nvml
from tests.workers.conftest import FAKE_WORKER


@pytest.mark.parametrize(("twin_gpu", "launched"), [("h100-80gb", 4096), ("a100-40gb", 8192)])
async def test_an_sglang_worker_on_a_gpu_nvml_sizes_as_the_twins_is_launched_with_the_forecasts_moves(
    tmp_path: Path, twin_gpu: str, launched: int
) -> None:
    """0.97 of an 80 GB H100 leaves under 2 GB for activations and a full 8192-token chunk needs 2 GB:
    with the twin on an H100 (NVML's device 0 is one) the worker starts with 4096, journaled; with
    the twin on an A100-40GB the GPU is not the twin's and the worker starts as configured."""
    doc: dict[str, Any] = {
        "engine": {"kind": "sglang", "workers": 1, "command": [sys.executable, str(FAKE_WORKER)],
                   "args": {"model_path": "meta-llama/Llama-3.1-8B-Instruct", "mem_fraction_static": 0.97,
                            "chunked_prefill_size": 8192, "max_running_requests": 64},
                   "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 30, "stop_grace_s": 5},
        "proxy": {"gpu_sample_interval_s": 60},
        "control": {"mode": "auto", "journal_path": str(tmp_path / "decisions.jsonl")},
    }  # fmt: skip
    policy = parse_policy(doc, "<test>")
    pool = Supervisor(policy.engine, poll_interval_s=0.1)
    constants = replace(CONSTANTS, twin_gpu=twin_gpu, available_mem_band_gb=(1.0, 80.0))
    app = build_app(policy, pool, gpu_sampler=lambda: sample_with(_Nvml(count=1)), control_constants=constants)
    runner, _ = await serve(app, "127.0.0.1", 0)
    try:
        assert [w.id for w in pool.workers()] == ["w0"]  # listed (starting) once the app is up, as before
        await wait_until(
            lambda: bool(pool.workers()) and pool.workers()[0].state is WorkerState.READY, "ready", timeout=30
        )
        (info,) = pool.workers()
        assert info.args["chunked_prefill_size"] == launched and info.restarts == 0
        async with aiohttp.ClientSession() as s, s.get(info.url + "/args") as r:
            flags = (await r.json())["engine_flags"]
        assert flags[flags.index("--chunked-prefill-size") + 1] == str(launched)
        entries = app[PROXY].controllers["default"].journal.entries()
        if launched == 8192:
            assert entries == []
        else:
            (entry,) = entries
            assert entry["rule"] == "activations_fit" and entry["status"] == "applied"
            assert entry["changes"] == {"chunked_prefill_size": [8192, 4096]}
            assert entry["detail"].endswith("(llama-3.1-8b on h100-80gb: the size NVML reports)")
    finally:
        await runner.cleanup()
    assert all(w.state is WorkerState.STOPPED for w in pool.workers())
