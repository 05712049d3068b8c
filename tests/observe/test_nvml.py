"""The NVML sampler: the real no-GPU path on this machine, and the device mapping over an object
that answers NVML's calls (pynvml cannot reach a GPU here)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from proxy.observe.nvml import GpuReport, sample_gpus, sample_with

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
