"""Carrying out a decision on one worker without losing a request.

Rolling restart (:meth:`Rollout.restart`), one worker at a time (the controller never starts a
second while one is under way):

1. stop dispatching to the worker (the dispatcher's drain flag; the pool shows it DRAINING);
2. let its running requests finish, up to ``drain_timeout_s``;
3. take back what is still waiting: every request on it that produced no output yet is aborted
   upstream and put back at the front of the proxy's queue (its handler answers it later, from
   whichever worker serves it: nothing is lost, nothing reaches the client twice);
4. give the taken-back handlers ``settle_s`` to let go, then restart the worker with the new args
   and wait for its health check;
5. resume dispatching. With a single worker the proxy's queue holds the traffic meanwhile.

A worker that died (:meth:`Rollout.revive`) has nothing left to drain: the request path already
retried what had produced no output and answered the rest with an error; it is restarted at once.
"""

from __future__ import annotations

import logging
from typing import Mapping, Protocol

from proxy.control.controller import ActResult
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState

__all__ = ["Drainable", "Rollout"]

_log = logging.getLogger(__name__)


class Drainable(Protocol):
    """The request path's hooks (``proxy.dispatch.Dispatcher``)."""

    def drain(self, worker_id: WorkerId, draining: bool = True) -> None: ...

    async def wait_idle(self, worker_id: WorkerId, timeout_s: float | None = None) -> bool: ...

    def take_back(self, worker_id: WorkerId) -> int: ...

    def open_attempts(self, worker_id: WorkerId) -> int: ...


class RestartablePool(Protocol):
    def get(self, worker_id: WorkerId) -> WorkerInfo: ...

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo: ...


class Rollout:
    def __init__(self, pool: RestartablePool, dispatcher: Drainable, *, drain_timeout_s: float, settle_s: float = 10.0) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.drain_timeout_s = drain_timeout_s
        self.settle_s = settle_s

    def _set_state(self, worker_id: WorkerId, state: WorkerState) -> None:
        set_state = getattr(self.pool, "set_state", None)
        if set_state is None:
            return
        try:
            set_state(worker_id, state)
        except Exception as exc:  # the worker changed state meanwhile (it died): nothing to mark
            _log.debug("cannot mark %s %s: %s", worker_id, state, exc)

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        details: dict[str, object] = {}
        self.dispatcher.drain(worker_id, True)
        if self.pool.get(worker_id).state is WorkerState.READY:
            self._set_state(worker_id, WorkerState.DRAINING)
        try:
            details["in_flight_at_drain"] = self.dispatcher.open_attempts(worker_id)
            drained = await self.dispatcher.wait_idle(worker_id, self.drain_timeout_s)
            details["drained"] = drained
            details["taken_back"] = 0
            if not drained:
                details["taken_back"] = self.dispatcher.take_back(worker_id)
                settled = await self.dispatcher.wait_idle(worker_id, self.settle_s)
                details["still_running_at_restart"] = 0 if settled else self.dispatcher.open_attempts(worker_id)
            _log.info("restarting %s: %s (%s)", worker_id, reason, details)
            info = await self.pool.restart(worker_id, args, reason)
        except BaseException:
            if self.pool.get(worker_id).state is WorkerState.DRAINING:
                self._set_state(worker_id, WorkerState.READY)
            raise
        finally:
            self.dispatcher.drain(worker_id, False)
        return ActResult(info=info, details=details)

    async def revive(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        self.dispatcher.drain(worker_id, False)
        _log.info("reviving %s: %s", worker_id, reason)
        info = await self.pool.restart(worker_id, args, reason)
        return ActResult(info=info, details={})
