"""GPU memory and utilization per device, read through NVML (``pynvml`` from ``nvidia-ml-py``).

    report = sample_gpus()
    if report.available: report.devices[0].memory_used_bytes
    else: report.reason        # "NVML Shared Library Not Found" on a machine without a GPU

``pynvml`` is imported on first use, and every NVML failure (no library, no driver, no device, a
call the device does not support) becomes data: the whole report says why no GPU could be read,
or a single field is ``None`` when only that query is unsupported (utilization under MIG). Nothing
here raises. Run ``python -m proxy.observe.nvml`` to print one report as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


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
        gpu_pct, mem_pct = int(util.gpu), int(util.memory)
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
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def sample_gpus() -> GpuReport:
    """One report of every GPU NVML sees, or the no-GPU state with the reason."""
    try:
        import pynvml
    except ImportError as exc:
        return GpuReport(time=time.monotonic(), reason=f"no GPU: pynvml is not installed ({exc})")
    return sample_with(pynvml)


def main(argv: list[str] | None = None) -> int:
    del argv
    json.dump(sample_gpus().to_json(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
