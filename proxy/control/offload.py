"""Where the planner's CPU-bound work runs: its replays (a plan, the check of an acted plan's twin).

A plan is seconds of pure Python. In a thread of the proxy's own process it holds the interpreter's
lock (the GIL) against the event loop that relays every request: the loop waits up to a switch
interval (5 ms) for the lock after each wake-up, so while a plan computes, a relayed chunk's tail
latency grows from a fraction of a millisecond to tens (measured: p99 of a local echo 0.4 ms idle,
21 ms beside a busy thread, 0.3 ms beside a busy process). :class:`PlanProcess` runs that work in one
process of its own instead: the loop keeps its lock, and on a host with a core to spare the plan
costs the relaying nothing. :func:`in_thread` is the default for a controller built without one (the
tests that drive a controller by hand).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Protocol, TypeVar

__all__ = ["NICENESS", "Offload", "PlanProcess", "PlanProcessDied", "in_thread"]

_log = logging.getLogger("pacer.control")

A = TypeVar("A")
R = TypeVar("R")

STOP_TIMEOUT_S = 5.0  # a process that does not end on SIGTERM within this is killed
NICENESS = 10  # where there is no idle scheduling class: the planner's process yields the CPU this much


class Offload(Protocol):
    """Runs ``fn(arg)`` off the event loop; ``fn`` and ``arg`` (and the result) may cross a process."""

    def __call__(self, fn: Callable[[A], R], arg: A, /) -> Awaitable[R]: ...


def in_thread(fn: Callable[[A], R], arg: A, /) -> Awaitable[R]:
    """``fn(arg)`` in a thread of this process (it shares the interpreter's lock with the loop)."""
    return asyncio.to_thread(fn, arg)


class PlanProcessDied(RuntimeError):
    """The planner's process ended while computing (killed, out of memory): that computation is lost,
    the next one starts a new process."""


def _background() -> None:
    """The child's set-up: it leaves Ctrl-C to the proxy, which stops it (no second traceback on the
    terminal), and it takes only CPU time nothing else wants: Linux's idle scheduling class where
    there is one, else ``NICENESS`` above the proxy. A plan is background work that may take longer
    on a busy host; the relaying, and an engine's scheduler on the same host, may not. On the
    benchmarks' two cores the replays slowed the simulated engine beside them by 9-10 % in the mixed
    scenario at the proxy's priority and at niceness +10 alike (an engine that needs a whole core
    still shares it with a niced process at a tenth)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # no idle class on this platform, or not allowed
        with contextlib.suppress(OSError):
            os.nice(NICENESS)


class PlanProcess:
    """One process, started at the first call (a proxy whose planner is off starts none), that runs
    each call in turn; the owner of its lifetime (``async with``): leaving stops it, a computation in
    flight included (its result is dropped, as a cancelled plan's is). Spawned, not forked: the proxy
    runs threads (NVML, the batch store) that a fork would copy mid-state. A call whose process died
    raises :class:`PlanProcessDied`, and the next call starts another. It runs on CPU time nothing
    else wants (:func:`_background`)."""

    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None
        self._closed = False

    async def __aenter__(self) -> PlanProcess:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(_stop, executor)

    def _running(self) -> ProcessPoolExecutor:
        if self._closed:
            raise RuntimeError("the planner's process is stopped")
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_background
            )
            _log.info("the planner's replays run in a process of their own")
        return self._executor

    async def __call__(self, fn: Callable[[A], R], arg: A, /) -> R:
        executor = self._running()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, arg)
        except BrokenProcessPool as exc:
            if self._executor is executor:
                self._executor = None
                await asyncio.to_thread(_stop, executor)
            _log.warning("the planner's process died while computing %s: the next plan starts another", fn.__name__)
            raise PlanProcessDied(f"the planner's process died while computing {fn.__name__}") from exc

    @property
    def pids(self) -> tuple[int, ...]:
        """The process's id, once started (for the tests that check it runs apart and is stopped)."""
        return tuple(_processes(self._executor)) if self._executor is not None else ()


def _processes(executor: ProcessPoolExecutor) -> dict[int, BaseProcess]:
    """The executor's processes by id (a private attribute, stable since Python 3.2: what 3.14's
    ``terminate_workers`` reads too)."""
    return dict(getattr(executor, "_processes", None) or {})


def _stop(executor: ProcessPoolExecutor) -> None:
    """Stop ``executor``'s process now, whatever it computes: Python 3.14's ``terminate_workers``,
    and before it the same by hand (the executor keeps its processes by id; an ended one is left)."""
    terminate = getattr(executor, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list(_processes(executor).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
