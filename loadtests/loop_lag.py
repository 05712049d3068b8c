"""How late an asyncio event loop runs a timer, measured from inside the process, for benchmarks.

A probe task sleeps ``INTERVAL_S`` again and again; each wake-up's lateness is the loop's lag (the
time nothing else on that loop could run either). For every lag of ``STALL_MS`` or more it records
what the loop's thread did meanwhile, from ``/proc/thread-self/schedstat`` and ``gc.callbacks``:
ran (its own work, or the collector's), waited for a CPU (starved), or neither (blocked in a call).
Lines of JSON go to a file four times a second, read back with :func:`read_window`.

A benchmark's own loop runs it with :func:`probed`; another program's loop is probed without
changing it by starting it through this module, which wraps ``uvloop.run`` and ``asyncio.run``:

    python -m loadtests.loop_lag OUT.jsonl proxy serve --policy p.toml ...

A stall shorter than the interval is seen only when it covers a wake-up, so the lags are samples
of how late the loop was at random moments. The probe costs a timer and a ``/proc`` read per tick
(next to nothing while the loop is busy anyway; about 1 % of an idle core) and nothing per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import runpy
import sys
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

INTERVAL_S = 0.02
STALL_MS = 5.0
FLUSH_S = 0.25

T = TypeVar("T")


@dataclass
class _GcClock:
    """Seconds spent in the collector so far, and each full (generation 2) pass since last taken:
    [start, wall ms, CPU ms, objects freed]."""

    seconds: float = 0.0
    full_passes: list[list[float]] = field(default_factory=list)
    _started: float = 0.0
    _cpu_started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        full = info.get("generation") == 2
        if phase == "start":
            self._started = time.perf_counter()
            if full:
                self._cpu_started = time.thread_time()
            return
        now = time.perf_counter()
        self.seconds += now - self._started
        if full:
            wall, cpu = (now - self._started) * 1000, (time.thread_time() - self._cpu_started) * 1000
            self.full_passes.append([round(self._started, 4), round(wall, 2), round(cpu, 2), info.get("collected", 0)])

    def take_full_passes(self) -> list[list[float]]:
        taken, self.full_passes = self.full_passes, []
        return taken


@dataclass
class LagProbe:
    """The probe of the loop it is started on; writes to ``out`` (appended)."""

    out: Path
    interval_s: float = INTERVAL_S
    stall_ms: float = STALL_MS
    _gc: _GcClock = field(default_factory=_GcClock)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        gc.callbacks.append(self._gc)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._gc)

    async def _run(self) -> None:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # the loop's own thread
        try:
            with open(self.out, "a", buffering=1) as sink:
                await self._ticks(fd, sink)
        finally:
            os.close(fd)

    async def _ticks(self, fd: int, sink: Any) -> None:
        ran0, waited0 = _schedstat(fd)
        line = _Line(time.perf_counter(), ran0, waited0, self._gc.seconds)
        try:
            while True:
                t0, gc0 = time.perf_counter(), self._gc.seconds
                await asyncio.sleep(self.interval_s)
                t1 = time.perf_counter()
                lag_ms = max(0.0, (t1 - t0 - self.interval_s) * 1000)
                line.lags_ms.append(round(lag_ms, 2))
                ran1, waited1 = _schedstat(fd)
                if lag_ms >= self.stall_ms:  # [due, lag, ran, waited, in the collector] (ms)
                    ms = [(ran1 - ran0) * 1000, (waited1 - waited0) * 1000, (self._gc.seconds - gc0) * 1000]
                    line.stalls.append([round(t0 + self.interval_s, 4), round(lag_ms, 2), *(round(v, 2) for v in ms)])
                ran0, waited0 = ran1, waited1
                if t1 - line.t0 >= FLUSH_S:
                    sink.write(line.close(t1, ran1, waited1, self._gc))
                    line = _Line(t1, ran1, waited1, self._gc.seconds)
        finally:
            if line.lags_ms:
                sink.write(line.close(time.perf_counter(), *_schedstat(fd), self._gc))


@dataclass
class _Line:
    """What the probe saw since ``t0``, until written."""

    t0: float
    ran0: float
    waited0: float
    gc0: float
    lags_ms: list[float] = field(default_factory=list)
    stalls: list[list[float]] = field(default_factory=list)

    def close(self, t1: float, ran: float, waited: float, gc_clock: _GcClock) -> str:
        line = {
            "t0": round(self.t0, 4),
            "t1": round(t1, 4),
            "lags_ms": self.lags_ms,
            "stalls": self.stalls,
            "ran_s": round(ran - self.ran0, 5),
            "waited_s": round(waited - self.waited0, 5),
            "gc_s": round(gc_clock.seconds - self.gc0, 5),
            "gc_full_passes": gc_clock.take_full_passes(),
        }
        return json.dumps(line, separators=(",", ":")) + "\n"


def _schedstat(fd: int) -> tuple[float, float]:
    """Seconds this thread ran and waited runnable for a CPU, so far."""
    ran, waited = os.pread(fd, 128, 0).split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


async def probed(main: Coroutine[Any, Any, T], out: Path) -> T:
    """Await ``main`` with a :class:`LagProbe` on the running loop writing to ``out``."""
    probe = LagProbe(out)
    probe.start()
    try:
        return await main
    finally:
        await probe.stop()


@dataclass(frozen=True)
class Stall:
    """One late wake-up: the loop ran nothing else from ``start`` (the timer's due time) to ``end``."""

    start: float
    end: float
    ran_ms: float
    waited_ms: float
    gc_ms: float

    @property
    def lag_ms(self) -> float:
        return (self.end - self.start) * 1000

    @property
    def kind(self) -> str:
        """What held the loop: ``starved`` (its thread waited for a CPU for half the lag or more), ``gc``
        (the collector), ``busy`` (its own work), or ``blocked`` (neither ran nor waited: a blocking call)."""
        half = self.lag_ms / 2
        if self.waited_ms >= half:
            return "starved"
        if self.gc_ms >= half:
            return "gc"
        return "busy" if self.ran_ms >= half else "blocked"


@dataclass(frozen=True)
class LagWindow:
    """What a probe wrote between two ``perf_counter`` times."""

    lags_ms: list[float]
    stalls: list[Stall]
    ran_s: float
    waited_s: float
    gc_s: float
    full_passes: list[list[float]]  # the collector's full passes: [start, wall ms, CPU ms, objects freed]


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        for text in fh:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by the process's end
                yield json.loads(text)


def written_past(path: Path, t: float) -> bool:
    """Whether the probe has written everything :func:`read_window` reads up to ``t``: a line whose middle
    lies past ``t`` (the lines go out in order, each with the stalls that ended by its end)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 16384))  # the last lines: a line is under 1 KB
            tail = fh.read().rsplit(b"\n", 2)
    except FileNotFoundError:
        return False
    try:
        last = json.loads(tail[-2]) if len(tail) >= 2 else None
    except json.JSONDecodeError:  # a line cut at the start of the tail read
        return False
    return last is not None and (last["t0"] + last["t1"]) / 2 > t


def read_window(path: Path, t0: float, t1: float) -> LagWindow | None:
    """What the probe saw from ``t0`` to ``t1`` (``perf_counter`` times, one clock for every process on
    Linux): its lines whose middle lies there, and the stalls that overlap it; None when no line does
    (no probe ran)."""
    lags: list[float] = []
    stalls: list[Stall] = []
    full: list[list[float]] = []
    ran = waited = gc_s = 0.0
    found = False
    for line in _lines(path):
        stalls += [
            Stall(s, s + lag / 1000, r, w, g) for s, lag, r, w, g in line["stalls"] if s < t1 and s + lag / 1000 > t0
        ]
        if not t0 <= (line["t0"] + line["t1"]) / 2 <= t1:
            continue
        found = True
        lags += line["lags_ms"]
        full += line["gc_full_passes"]
        ran, waited, gc_s = ran + line["ran_s"], waited + line["waited_s"], gc_s + line["gc_s"]
    return LagWindow(lags, stalls, ran, waited, gc_s, full) if found else None


def _install(out: Path) -> None:
    """Every ``uvloop.run`` / ``asyncio.run`` of this process from now on runs with a probe."""

    def wrapping(run: Any) -> Any:
        def run_probed(main: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
            return run(probed(main, out), **kwargs)

        return run_probed

    asyncio.run = wrapping(asyncio.run)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.run = wrapping(uvloop.run)


def main(argv: list[str]) -> None:
    """``OUT MODULE ARGS...``: run ``python -m MODULE ARGS...`` in this process with its loop probed."""
    if len(argv) < 2:
        sys.exit("usage: python -m loadtests.loop_lag OUT.jsonl MODULE [ARGS...]")
    out, module = Path(argv[0]), argv[1]
    _install(out)
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
