"""The seam between the supervisor (which owns worker processes) and the request path.

The supervisor (``proxy.workers.supervisor``) implements :class:`WorkerPool`; the front door,
pacing and dispatch only read :class:`WorkerInfo` values and react to state changes. The
controller asks the pool for rolling restarts with new arguments.

A worker's :class:`WorkerState` is the one truth of whether it may get new requests (READY) or
not: the rollout drains it (``set_state``), the controller holds one about to die and the request
path reports one it cannot reach (``hold``, ``report_unreachable``); the pool's own transitions
(DOWN on exit, STARTING, READY) lift those.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

WorkerId = str


class WorkerState(StrEnum):
    STARTING = "starting"  # process launched, /health not yet 200: no traffic
    READY = "ready"  # takes traffic
    DRAINING = "draining"  # no new traffic; running requests finish (before a restart or stop)
    DOWN = "down"  # died or unreachable; the supervisor may restart it
    STOPPED = "stopped"  # stopped on purpose


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """A snapshot of one worker as the supervisor sees it."""

    id: WorkerId
    url: str  # base URL, e.g. "http://127.0.0.1:30001"
    state: WorkerState
    managed: bool  # False for kind = "external" (the proxy neither starts nor restarts it)
    args: Mapping[str, object] = field(default_factory=dict)  # engine args, SGLang/vLLM names with underscores
    argv: tuple[str, ...] = ()  # the full command line it was started with (managed only)
    pid: int | None = None
    restarts: int = 0
    last_error: str | None = None  # why it is down, in words
    exit_code: int | None = None  # of the last process that exited (negative: killed by that signal)
    log_path: str | None = None  # the file its stdout+stderr are appended to (managed only)
    pool: str = "default"  # the policy's pool it belongs to (the [engine] table is the pool "default")
    model: str | None = None  # the model its pool serves (None: whatever the worker reports)
    gpus: tuple[int, ...] = ()  # the GPU ids it was given (its CUDA_VISIBLE_DEVICES); () not placed
    node: str | None = None  # the host it runs on when that is not the proxy's (a Ray node's address)
    # down, and nothing will start it again (the controller's call: the policy revives nothing);
    # its next launch (an operator's restart or trial) lifts it
    stays_down: bool = False
    # in a crash loop the controller goes on reviving it (it dies as it starts): lifted once it is READY
    crash_loop: bool = False


StateListener = Callable[[WorkerInfo], Awaitable[None] | None]

_log = logging.getLogger("pacer.workers")


def tell_listeners(listeners: Iterable[StateListener], info: WorkerInfo, tasks: set[asyncio.Task[None]]) -> None:
    """Each listener hears of ``info``. One that raises is logged and the others still hear; one that
    answers with an awaitable runs on as a task kept in ``tasks`` until it ends (its failure logged)."""
    for listener in list(listeners):
        try:
            result = listener(info)
        except Exception:
            _log.exception("state listener failed")
            continue
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(_await_listener(result))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


async def _await_listener(result: Awaitable[None]) -> None:
    try:
        await result
    except Exception:
        _log.exception("state listener failed")


LineListener = Callable[[WorkerId, str], None]  # called with each output line as it is read
# a worker as configured -> the args to launch it with
LaunchPlanner = Callable[[WorkerInfo], Awaitable[Mapping[str, object]]]


class WorkerPool(Protocol):
    def workers(self) -> Sequence[WorkerInfo]: ...

    def get(self, worker_id: WorkerId) -> WorkerInfo: ...

    def add_listener(self, listener: StateListener) -> None:
        """Called after every state change of any worker."""

    async def start(self) -> None:
        """Launch managed workers (or register external ones) and return once all were tried."""

    async def stop(self) -> None:
        """Stop every managed worker: SIGTERM, then SIGKILL after a grace period."""

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        """Restart one managed worker with new engine args; returns once it is READY (or DOWN)."""

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        """READY -> DRAINING (stop sending before a restart) or DRAINING -> READY; notifies listeners."""

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        """Send nothing more to the worker until it starts again: READY -> DRAINING, a STARTING one
        comes up DRAINING once healthy, any other state as it is. The pool's own transitions lift it
        (DOWN when it exits, then STARTING, READY)."""

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        """The request path could not connect to the worker: take it out of READY now (notifies
        listeners); the pool brings it back when it answers again."""

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        """The controller's word on a DOWN managed worker (``why``, in words, joins its ``last_error``;
        listeners are told): ``for_good``, nothing will start it again (``stays_down``, until its next
        launch); else it is in a crash loop the controller goes on reviving (``crash_loop``, until it
        is READY), unless the run that died had been READY (it served: its deaths are no loop of dying
        as it starts). A worker in any other state, or external, is left as it is."""


@runtime_checkable
class WorkerLogs(Protocol):
    """A managed worker's output (stdout and stderr merged), line by line.

    Only a pool that starts its workers has it (``isinstance(pool, WorkerLogs)``); external workers'
    output is not the proxy's to read."""

    def tail(self, worker_id: WorkerId, n: int) -> list[str]:
        """The last ``n`` lines of the worker's current run (its last, once it died; a bounded ring)."""

    def add_line_listener(self, listener: LineListener) -> None:
        """Called synchronously with (worker_id, line) for each line of any worker."""


@runtime_checkable
class PlannedLaunches(Protocol):
    """A pool that starts its workers and lets the arguments of each one's first launch be planned
    (the controller's forecast of its start-up); external workers are not launched, nor planned."""

    def plan_launches(self, planner: LaunchPlanner) -> None:
        """``planner`` is called with each managed worker, as configured, before its first launch and
        returns the arguments to launch it with (set before ``start``)."""
