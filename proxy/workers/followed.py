"""The leader's workers as a follower replica serves them: the roster in the store, never started here.

:class:`FollowedPool` is a :class:`~proxy.workers.base.WorkerPool` over the roster the leader publishes
(:mod:`proxy.store.roster`): each worker's url, state, arguments and pid as the leader last saw them.
It sends to them as to external workers; what this replica learns on its own (a worker it cannot
reach, a hold) holds here until the leader's record of that worker changes or ``local_hold_s`` passes.
It restarts nothing: that is the leader's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.workers.base import StateListener, WorkerId, WorkerInfo, WorkerState, tell_listeners

__all__ = ["FollowedPool", "info_of", "record_of"]

_log = logging.getLogger(__name__)


def record_of(info: WorkerInfo) -> dict[str, Any]:
    """``info`` as the roster keeps it (JSON's types)."""
    return {
        "id": info.id,
        "url": info.url,
        "state": info.state.value,
        "managed": info.managed,
        "args": {k: v for k, v in info.args.items()},
        "argv": list(info.argv),
        "pid": info.pid,
        "restarts": info.restarts,
        "last_error": info.last_error,
        "exit_code": info.exit_code,
        "pool": info.pool,
        "model": info.model,
        "gpus": list(info.gpus),
        "node": info.node,
        "stays_down": info.stays_down,
        "crash_loop": info.crash_loop,
    }


def info_of(record: Mapping[str, Any]) -> WorkerInfo:
    """The :class:`WorkerInfo` a roster record gives (its log is on the leader's host: none here)."""
    return WorkerInfo(
        id=str(record["id"]),
        url=str(record["url"]),
        state=WorkerState(record["state"]),
        managed=bool(record.get("managed", True)),
        args=dict(record.get("args") or {}),
        argv=tuple(str(a) for a in record.get("argv") or ()),
        pid=record.get("pid"),
        restarts=int(record.get("restarts") or 0),
        last_error=record.get("last_error"),
        exit_code=record.get("exit_code"),
        pool=str(record.get("pool") or "default"),
        model=record.get("model"),
        gpus=tuple(int(g) for g in record.get("gpus") or ()),
        node=record.get("node"),
        stays_down=bool(record.get("stays_down")),
        crash_loop=bool(record.get("crash_loop")),
    )


@dataclass(frozen=True, slots=True)
class _Local:
    """A state this replica set on its own, over the leader's ``under`` record, at ``since``."""

    state: WorkerState
    under: Mapping[str, Any]
    since: float
    error: str | None = None


class FollowedPool:
    """Implements :class:`~proxy.workers.base.WorkerPool` over the leader's roster."""

    def __init__(self, *, local_hold_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._records: dict[WorkerId, Mapping[str, Any]] = {}
        self._local: dict[WorkerId, _Local] = {}
        self._listeners: list[StateListener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._hold_s = local_hold_s
        self._clock = clock

    # -- the roster
    def apply(self, records: Sequence[Mapping[str, Any]]) -> None:
        """The roster as read now: each worker whose state here changes is told to the listeners."""
        now = self._clock()
        for record in records:
            worker_id = str(record["id"])
            before = self.info(worker_id) if worker_id in self._records else None
            self._records[worker_id] = record
            local = self._local.get(worker_id)
            if local is not None and (local.under != record or now - local.since > self._hold_s):
                del self._local[worker_id]
            after = self.info(worker_id)
            if before is None or before != after:
                self._tell(after)

    def info(self, worker_id: WorkerId) -> WorkerInfo:
        info = info_of(self._records[worker_id])
        local = self._local.get(worker_id)
        if local is None:
            return info
        return dataclasses.replace(info, state=local.state, last_error=local.error or info.last_error)

    # -- WorkerPool
    def workers(self) -> list[WorkerInfo]:
        return [self.info(worker_id) for worker_id in self._records]

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        from proxy.workers.supervisor import WorkerError

        if worker_id not in self._records:
            raise WorkerError(f"no worker {worker_id!r} in the leader's roster")
        return self.info(worker_id)

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        """Nothing to start: the replica reads the roster (:meth:`apply`)."""

    async def stop(self) -> None:
        """Nothing to stop: the workers are the leader's."""

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        from proxy.workers.supervisor import WorkerError

        raise WorkerError(f"worker {worker_id} is the leader's to restart (this replica follows)")

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        return self._set_local(worker_id, state)

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        if self.get(worker_id).state is WorkerState.READY:
            return self._set_local(worker_id, WorkerState.DRAINING)
        return self.get(worker_id)

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        if self.get(worker_id).state in (WorkerState.READY, WorkerState.DRAINING):
            self._set_local(worker_id, WorkerState.DOWN, error=f"unreachable: {error}")

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        """The leader's controllers decide that."""

    # -- helpers
    def _set_local(self, worker_id: WorkerId, state: WorkerState, *, error: str | None = None) -> WorkerInfo:
        before = self.get(worker_id)
        self._local[worker_id] = _Local(state, self._records[worker_id], self._clock(), error)
        after = self.info(worker_id)
        if after != before:
            self._tell(after)
        return after

    def _tell(self, info: WorkerInfo) -> None:
        tell_listeners(self._listeners, info, self._tasks)
