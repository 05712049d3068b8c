"""On a host with a GPU (skipped elsewhere): a real ``pacer serve`` reads the devices through NVML
and places its workers on them.

- ``/admin/gpus`` and ``/metrics`` show each device NVML sees, with the total memory NVML reads;
- ``gpus = "auto"`` gives the pool's worker the host's first GPU (its process's CUDA_VISIBLE_DEVICES),
  and a simulated pool beside it may name GPUs the host lacks (the simulator's are modelled);
- ``pacer check-policy`` refuses a real engine's pool naming a GPU the host lacks, with the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli import main
from proxy.observe.nvml import sample_gpus
from tests.harness.serve_process import pacer_serve
from tests.harness.wait import wait_until
from tests.observe.test_nvml import _has_gpu
from tests.server.test_fleet_serve import visible_devices, wait_all_ready
from tests.server.test_gpus import _gpu_series

pytestmark = pytest.mark.skipif(not _has_gpu(), reason="no GPU here")

POLICY = """
[proxy]
gpu_sample_interval_s = 0.2

[[pool]]
name = "placed"
model = "placed-model"
kind = "sim"
gpus = "auto"

[pool.args]
sim_time_scale = 20.0
sim_startup_seconds = 0.3
enable_metrics = true

[[pool]]
name = "modelled"
model = "modelled-model"
kind = "sim"
gpus = [{past}]

[pool.args]
sim_time_scale = 20.0
sim_startup_seconds = 0.3
enable_metrics = true
"""


async def _gpus_sampled(url: str) -> dict[str, Any]:
    async def sampled() -> dict[str, Any] | None:
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/gpus") as r:
            payload: dict[str, Any] = await r.json()
        return payload if payload.get("devices") else None

    return await wait_until(sampled, "/admin/gpus to show a device", every=0.1)


async def test_serve_reads_the_host_gpus_and_places_an_auto_pool_on_them(tmp_path: Path) -> None:
    host = sample_gpus()
    visible = len(host.devices)
    (tmp_path / "policy.toml").write_text(POLICY.replace("{past}", str(visible)))
    with pacer_serve(tmp_path) as (url, log):
        ws = await wait_all_ready(url, log, count=2)
        by_pool = {w["pool"]: w for w in ws.values()}
        assert visible_devices(by_pool["placed"]["pid"]) == "0"
        assert visible_devices(by_pool["modelled"]["pid"]) == str(visible)  # a GPU this host does not have

        payload = await _gpus_sampled(url)
        assert payload["available"] is True and payload["driver_version"] == host.driver_version
        seen = {d["index"]: d for d in payload["devices"]}
        assert {i: (d["name"], d["memory_total_bytes"]) for i, d in seen.items()} == {
            d.index: (d.name, d.memory_total_bytes) for d in host.devices
        }
        for d in seen.values():
            assert d["memory_used_bytes"] + d["memory_free_bytes"] <= d["memory_total_bytes"]

        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            series = _gpu_series(await r.text())
        assert series[("pacer_gpu_available", ())] == 1.0
        for d in host.devices:
            labels = (("gpu", str(d.index)), ("name", d.name))
            assert series[("pacer_gpu_memory_total_bytes", labels)] == d.memory_total_bytes


def test_check_policy_refuses_a_real_engine_on_a_gpu_the_host_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    visible = len(sample_gpus().devices)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[[pool]]\nname = "r"\nmodel = "m"\nkind = "sglang"\ngpus = [{visible}]\n\n[pool.args]\nmodel_path = "m"\n'
    )
    assert main(["check-policy", str(policy)]) == 2
    err = capsys.readouterr().err
    assert f"pool.r.gpus: GPU {visible} does not exist: NVML sees {visible}" in err
