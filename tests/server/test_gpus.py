"""GPU gauges on ``/metrics`` and ``GET /admin/gpus``: a fed report of two devices, the real sampler
(no GPU on this machine), sampling turned off, and the time before the first sample."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.compose import build_app, serve
from proxy.observe.nvml import GpuReport, Sampler, sample_gpus, sample_with
from proxy.policy import parse_policy
from proxy.server.state import PROXY, ProxyState
from tests.harness.fake_engine import FakeEngine
from tests.harness.static_pool import StaticPool
from tests.harness.wait import wait_until
from tests.observe.test_nvml import _has_gpu, _Nvml

ADMIN = {"Authorization": "Bearer adm-1"}
Start = Callable[..., Any]


@pytest.fixture
async def start_proxy(tmp_path) -> AsyncIterator[Start]:
    """``await start_proxy(sampler, interval_s)`` -> (base URL, state); an admin key ``adm-1``."""
    admin = tmp_path / "admin.txt"
    admin.write_text("adm-1\n")
    cleanups: list[Callable[[], Any]] = []

    async def start(sampler: Sampler, interval_s: float = 0.05) -> tuple[str, ProxyState]:
        worker = FakeEngine()
        url = await worker.start()
        cleanups.append(worker.stop)
        doc = {
            "proxy": {"gpu_sample_interval_s": interval_s},
            "auth": {"admin_key_file": str(admin)},
            "engine": {"kind": "external", "urls": [url]},
        }
        app = build_app(parse_policy(doc, "<test>"), StaticPool([url]), gpu_sampler=sampler)
        runner, port = await serve(app, "127.0.0.1", 0)
        cleanups.append(runner.cleanup)
        return f"http://127.0.0.1:{port}", app[PROXY]

    yield start
    for fn in reversed(cleanups):
        await fn()


async def _first_sample(st: ProxyState) -> GpuReport:
    return await wait_until(lambda: st.gpus is not None and st.gpus.last, "a first GPU sample")


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def _gpu_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The ``pacer_gpu_*`` samples of a metrics page, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("pacer_gpu_")
        for s in family.samples
    }


async def test_two_devices_show_as_gauges_and_json(start_proxy: Start) -> None:
    base, st = await start_proxy(lambda: sample_with(_Nvml()))
    report = await _first_sample(st)
    status, text = await _get(base + "/metrics")
    assert status == 200
    total = report.devices[0].memory_total_bytes
    h100 = "NVIDIA H100 80GB HBM3"
    gpu0, gpu1 = (("gpu", "0"), ("name", h100)), (("gpu", "1"), ("name", h100))
    assert _gpu_series(text) == {
        ("pacer_gpu_available", ()): 1.0,
        ("pacer_gpu_memory_total_bytes", gpu0): total,
        ("pacer_gpu_memory_total_bytes", gpu1): total,
        ("pacer_gpu_memory_used_bytes", gpu0): 1e6,
        ("pacer_gpu_memory_used_bytes", gpu1): 2e6,
        ("pacer_gpu_memory_free_bytes", gpu0): total - 1e6,
        ("pacer_gpu_memory_free_bytes", gpu1): total - 2e6,
        ("pacer_gpu_utilization_pct", gpu0): 87.0,  # gpu 1 has no utilization counter: no sample
    }

    status, payload = await _get(base + "/admin/gpus")
    assert status == 401 and "error" in payload
    status, payload = await _get(base + "/admin/gpus", ADMIN)
    assert status == 200
    assert payload["available"] is True and payload["reason"] is None and payload["driver_version"] == "580.65.06"
    assert [d["uuid"] for d in payload["devices"]] == ["GPU-0", "GPU-1"]
    assert payload["devices"][1]["utilization_gpu_pct"] is None
    assert payload["interval_s"] == 0.05 and 0 <= payload["age_s"] < 2.0


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: the no-GPU state cannot be observed")
async def test_real_sampler_without_a_gpu_says_why(start_proxy: Start) -> None:
    base, st = await start_proxy(sample_gpus)
    await _first_sample(st)
    status, text = await _get(base + "/metrics")
    assert _gpu_series(text) == {("pacer_gpu_available", ()): 0.0}
    status, payload = await _get(base + "/admin/gpus", ADMIN)
    assert status == 200 and payload["available"] is False and payload["devices"] == []
    assert payload["reason"].startswith("no GPU") and "age_s" in payload


async def test_sampling_off(start_proxy: Start) -> None:
    def never() -> GpuReport:
        raise AssertionError("the watch is off: nothing samples")

    base, st = await start_proxy(never, interval_s=0)
    assert st.gpus is None
    status, text = await _get(base + "/metrics")
    assert _gpu_series(text) == {("pacer_gpu_available", ()): 0.0}
    status, payload = await _get(base + "/admin/gpus", ADMIN)
    assert status == 200 and payload["available"] is False
    assert payload["reason"] == "GPU sampling is off (proxy.gpu_sample_interval_s = 0)"


async def test_before_the_first_sample(start_proxy: Start) -> None:
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow() -> GpuReport:  # runs in the watch's worker thread
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=30)
        return sample_with(_Nvml())

    base, st = await start_proxy(slow)
    try:
        status, payload = await _get(base + "/admin/gpus", ADMIN)
        assert status == 200 and payload["available"] is False and payload["reason"] == "not sampled yet"
        status, text = await _get(base + "/metrics")
        assert _gpu_series(text) == {("pacer_gpu_available", ()): 0.0}
    finally:
        release.set()
    assert (await _first_sample(st)).available
