"""GPU memory and utilization per device, read through NVML (``pynvml`` from ``nvidia-ml-py``).

    report = sample_gpus()
    if report.available: report.devices[0].memory_used_bytes
    else: report.reason        # "NVML Shared Library Not Found" on a machine without a GPU

``pynvml`` is imported on first use, and every NVML failure (no library, no driver, no device, a
call the device does not support) becomes data: the whole report says why no GPU could be read,
or a single field is ``None`` when only that query is unsupported (utilization under MIG). Nothing
here raises. Run ``python -m proxy.observe.nvml`` to print one report as JSON.

:class:`GpuWatch` keeps the newest report for the running proxy (``/metrics``, ``/admin/gpus``):

    watch = GpuWatch(interval_s=5.0)
    task = asyncio.create_task(watch.run())   # samples in a worker thread every 5 s
    watch.last                                # None until the first sample, then the newest report
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDevice:
    index: int
    name: str
    uuid: str | None
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    utilization_gpu_pct: int | None  # % of the last sample period a kernel ran; None if unsupported
    utilization_memory_pct: int | None  # % of the period device memory was read or written


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuReport:
    """One NVML sample: the devices, or why there are none (``reason``)."""

    time: float  # monotonic seconds
    devices: tuple[GpuDevice, ...] = ()
    driver_version: str | None = None
    reason: str | None = None  # set when no GPU could be read

    @property
    def available(self) -> bool:
        return self.reason is None and bool(self.devices)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "available": self.available}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text and text not in type(exc).__name__ else type(exc).__name__


def _device(nvml: Any, index: int) -> GpuDevice:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        gpu_pct: int | None = int(util.gpu)
        mem_pct: int | None = int(util.memory)
    except nvml.NVMLError:
        gpu_pct = mem_pct = None  # not supported (MIG instances, some vGPUs)
    try:
        uuid: str | None = _text(nvml.nvmlDeviceGetUUID(handle))
    except nvml.NVMLError:
        uuid = None
    return GpuDevice(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=uuid,
        memory_total_bytes=int(mem.total),
        memory_used_bytes=int(mem.used),
        memory_free_bytes=int(mem.free),
        utilization_gpu_pct=gpu_pct,
        utilization_memory_pct=mem_pct,
    )


def sample_with(nvml: Any) -> GpuReport:
    """Read every device through ``nvml`` (the ``pynvml`` module or an object with its API)."""
    now = time.monotonic()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses, OSError from a broken library
        return GpuReport(time=now, reason=f"no GPU: NVML unavailable ({_describe(exc)})")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            return GpuReport(time=now, driver_version=driver, reason="no GPU: NVML reports 0 devices")
        return GpuReport(time=now, driver_version=driver, devices=tuple(_device(nvml, i) for i in range(count)))
    except Exception as exc:
        return GpuReport(time=now, reason=f"no GPU: NVML query failed ({_describe(exc)})")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def sample_gpus() -> GpuReport:
    """One report of every GPU NVML sees, or the no-GPU state with the reason."""
    try:
        import pynvml
    except ImportError as exc:
        return GpuReport(time=time.monotonic(), reason=f"no GPU: pynvml is not installed ({exc})")
    return sample_with(pynvml)


Sampler = Callable[[], GpuReport]


def _state_line(report: GpuReport) -> str:
    """What the watch logs: the devices found or why there are none (no figures that move)."""
    if not report.available:
        return report.reason or "no GPU"
    devices = ", ".join(f"#{d.index} {d.name} ({d.memory_total_bytes / 2**30:.0f} GiB)" for d in report.devices)
    return f"GPUs: {devices}; driver {report.driver_version}"


class GpuWatch:
    """Samples the GPUs every ``interval_s`` in a worker thread and keeps the newest report.

    It logs the state (devices found, or the no-GPU reason) at the first sample and again only
    when it changes. A sampler that raises does not end the loop: the report it leaves says
    "GPU sampling failed (...)".

        watch = GpuWatch(interval_s=5.0, sampler=lambda: sample_with(fake_nvml))
        await watch.sample_once()
        watch.last.available
    """

    def __init__(self, interval_s: float, sampler: Sampler = sample_gpus) -> None:
        self.interval_s = interval_s
        self._sampler = sampler
        self._last: GpuReport | None = None
        self._logged: str | None = None

    @property
    def last(self) -> GpuReport | None:
        return self._last

    async def sample_once(self) -> GpuReport:
        failed = False
        try:
            report = await asyncio.to_thread(self._sampler)
        except Exception as exc:  # sample_gpus never raises; another sampler might
            report = GpuReport(time=time.monotonic(), reason=f"GPU sampling failed ({_describe(exc)})")
            failed = True
        self._last = report
        line = _state_line(report)
        if line != self._logged:
            self._logged = line
            _log.log(logging.WARNING if failed else logging.INFO, "%s", line)
        return report

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)


def main(argv: list[str] | None = None) -> int:
    del argv
    json.dump(sample_gpus().to_json(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
