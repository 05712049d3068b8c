"""The NVML sampler: the real no-GPU path on this machine, and the device mapping over an object
that answers NVML's calls (pynvml cannot reach a GPU here); the watch that keeps the newest report;
on a GPU host with torch, memory and utilization that torch causes."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from proxy.observe.nvml import GpuDevice, GpuReport, GpuWatch, sample_gpus, sample_with
from tests.harness.wait import wait_until

pynvml = pytest.importorskip("pynvml")


def _has_gpu() -> bool:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except pynvml.NVMLError:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: the no-GPU state cannot be observed")
def test_no_gpu_is_a_state_not_an_error() -> None:
    report = sample_gpus()
    assert isinstance(report, GpuReport)
    assert not report.available
    assert report.devices == ()
    assert report.reason is not None and report.reason.startswith("no GPU")


@pytest.mark.skipif(not _has_gpu(), reason="no GPU here")
def test_real_gpu_report() -> None:
    report = sample_gpus()
    assert report.available, report.reason
    for dev in report.devices:
        assert dev.memory_total_bytes > 0
        assert dev.memory_used_bytes + dev.memory_free_bytes <= dev.memory_total_bytes * 1.01


def test_module_prints_json() -> None:
    out = subprocess.run([sys.executable, "-m", "proxy.observe.nvml"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report) >= {"available", "devices", "reason", "driver_version", "time"}
    assert report["available"] == _has_gpu()


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


class _Nvml:
    """Answers the NVML calls the sampler makes, for two devices; the second is a MIG-like
    device without utilization counters."""

    NVMLError = _NVMLError

    def __init__(self, *, init_error: Exception | None = None, count: int = 2) -> None:
        self.init_error = init_error
        self.count = count
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.65.06"

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        total = 85_520_809_984
        used = 1_000_000 * (h + 1)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h == 1:
            raise _NotSupported("Not Supported")
        return SimpleNamespace(gpu=87, memory=41)


def test_devices_are_mapped() -> None:
    nvml = _Nvml()
    report = sample_with(nvml)
    assert report.available and report.driver_version == "580.65.06"
    first, second = report.devices
    assert (first.index, first.name, first.uuid) == (0, "NVIDIA H100 80GB HBM3", "GPU-0")
    assert first.memory_used_bytes == 1_000_000
    assert first.memory_free_bytes == first.memory_total_bytes - 1_000_000
    assert (first.utilization_gpu_pct, first.utilization_memory_pct) == (87, 41)
    assert (second.utilization_gpu_pct, second.utilization_memory_pct) == (None, None)
    assert nvml.shutdowns == 1
    json.dumps(report.to_json())


@pytest.mark.parametrize(
    ("nvml", "reason"),
    [
        (_Nvml(init_error=_NVMLError("Driver Not Loaded")), "NVML unavailable (_NVMLError: Driver Not Loaded)"),
        (_Nvml(init_error=OSError("libnvidia-ml.so.1: cannot open")), "NVML unavailable (OSError"),
        (_Nvml(count=0), "0 devices"),
    ],
)
def test_failures_become_the_no_gpu_state(nvml: _Nvml, reason: str) -> None:
    report = sample_with(nvml)
    assert not report.available
    assert reason in (report.reason or "")


def _watch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "proxy.observe.nvml"]


async def test_watch_keeps_the_newest_report_and_logs_the_state_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.observe.nvml")
    calls = 0

    def sampler() -> GpuReport:
        nonlocal calls
        calls += 1
        return sample_with(_Nvml())

    watch = GpuWatch(interval_s=0.01, sampler=sampler)
    assert watch.last is None
    task = asyncio.create_task(watch.run())
    try:
        await wait_until(lambda: calls >= 5, "five samples taken")
        assert watch.last is not None and watch.last.available and len(watch.last.devices) == 2
        lines = _watch_lines(caplog)
        assert len(lines) == 1, lines
        assert lines[0].startswith("GPUs: #0 NVIDIA H100 80GB HBM3 (80 GiB), #1 ") and "driver 580.65.06" in lines[0]
        assert all(r.levelno == logging.INFO for r in caplog.records)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watch_survives_a_raising_sampler_and_logs_each_change(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.observe.nvml")
    script = ["gpus", "gpus", "boom", "boom", "boom", "gone", "gone", "gpus"]
    done = 0

    def sampler() -> GpuReport:
        nonlocal done
        step = script[min(done, len(script) - 1)]
        done += 1
        if step == "boom":
            raise RuntimeError("sampler bug")
        return sample_with(_Nvml() if step == "gpus" else _Nvml(count=0))

    watch = GpuWatch(interval_s=0.01, sampler=sampler)
    task = asyncio.create_task(watch.run())
    try:
        await wait_until(lambda: done >= len(script) + 2, "the whole script sampled, and two more")
        assert task.done() is False
        assert watch.last is not None and watch.last.available
        lines = _watch_lines(caplog)
        assert len(lines) == 4, lines  # found, failed, none, found again
        assert lines[0].startswith("GPUs: ") and lines[3] == lines[0]
        assert lines[1] == "GPU sampling failed (RuntimeError: sampler bug)"
        assert lines[2] == "no GPU: NVML reports 0 devices"
        levels = [r.levelno for r in caplog.records if r.name == "proxy.observe.nvml"]
        assert levels == [logging.INFO, logging.WARNING, logging.INFO, logging.INFO]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_failed_sample_replaces_the_report_with_its_reason() -> None:
    def sampler() -> GpuReport:
        raise OSError("libnvidia-ml.so.1: cannot open")

    report = await GpuWatch(interval_s=1.0, sampler=sampler).sample_once()
    assert not report.available and report.devices == ()
    assert report.reason == "GPU sampling failed (OSError: libnvidia-ml.so.1: cannot open)"


# --------------------------------------------------------------------------------------------------
# a real GPU with torch: what torch allocates and runs shows up in the report


def _torch_cuda():  # the torch module, or None where torch or CUDA is missing
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_device(report: GpuReport, torch) -> GpuDevice:
    """The NVML device that torch calls cuda:0 (CUDA may order or hide devices unlike NVML)."""
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
    for dev in report.devices:
        if uuid and dev.uuid is not None and dev.uuid.split("-", 1)[-1] == uuid:
            return dev
    return report.devices[0]


@pytest.mark.skipif(not _has_gpu(), reason="no GPU here")
def test_real_gpu_sees_torch_memory_and_matmuls() -> None:
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch with CUDA is not importable here")
    torch.zeros(1, device="cuda")  # the CUDA context first, so it is not counted as the allocation
    torch.cuda.synchronize()
    before = sample_gpus()
    assert before.available, before.reason
    block = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after = sample_gpus()
    grown = _torch_device(after, torch).memory_used_bytes - _torch_device(before, torch).memory_used_bytes
    del block
    torch.cuda.empty_cache()
    assert grown >= 3.5 * 2**30, f"memory used grew by {grown / 2**30:.2f} GiB"

    busy: list[int | None] = []
    stop = threading.Event()

    def sample_meanwhile() -> None:
        while not stop.wait(0.2):
            busy.append(_torch_device(sample_gpus(), torch).utilization_gpu_pct)

    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    sampler = threading.Thread(target=sample_meanwhile)
    sampler.start()
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for _ in range(20):
                torch.matmul(a, b)
            torch.cuda.synchronize()
    finally:
        stop.set()
        sampler.join(timeout=5)
        del a, b
        torch.cuda.empty_cache()
    assert busy, "no sample was taken while the matmuls ran"
    known = [pct for pct in busy if pct is not None]
    if known:  # None throughout: this device has no utilization counter (MIG)
        assert max(known) >= 50, f"utilization while busy: {busy}"
