"""A WorkerPool over fixed URLs whose states a test sets by hand (listeners are notified)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from proxy.workers.base import StateListener, WorkerId, WorkerInfo, WorkerState


class StaticPool:
    def __init__(self, urls: list[str]) -> None:
        self._infos = {
            f"w{i}": WorkerInfo(id=f"w{i}", url=u, state=WorkerState.READY, managed=False) for i, u in enumerate(urls)
        }
        self._listeners: list[StateListener] = []

    def workers(self) -> list[WorkerInfo]:
        return list(self._infos.values())

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return self._infos[worker_id]

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        self._infos[worker_id] = dataclasses.replace(self._infos[worker_id], state=state)
        for listener in self._listeners:
            listener(self._infos[worker_id])
        return self._infos[worker_id]

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        if self._infos[worker_id].state is WorkerState.READY:
            return self.set_state(worker_id, WorkerState.DRAINING)
        return self._infos[worker_id]

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        self.set_state(worker_id, WorkerState.DOWN)

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        return None  # its workers are external: the pool's declare_down leaves them as they are

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        raise NotImplementedError("static workers cannot be restarted")
