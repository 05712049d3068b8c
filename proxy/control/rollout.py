"""Carrying out a decision on one worker without losing a request.

Rolling restart (:meth:`Rollout.restart`), one worker at a time (the controller never starts a
second while one is under way):

1. stop dispatching to the worker: the pool marks it DRAINING (its state is the one truth of
   "send nothing new"; the dispatcher sends only to READY workers);
2. let its running requests finish, up to ``drain_timeout_s``, but only while they do finish: the
   drain is watched in ``drain_slices`` slices, and a slice in which fewer than ``drain_progress``
   of the requests open at its start finished ends it early. Waiting on a batch whose outputs are
   far from done (long outputs, or a restart soon after the start) only idles the GPU: what finishes
   in the drain is worth the time only while it finishes;
3. take back what has produced no output yet, running or waiting: it is aborted upstream and put
   back at the front of the proxy's queue (its handler answers it later, from whichever worker
   serves it: nothing is lost, nothing reaches the client twice);
4. wait for what cannot be taken back (streams that already sent output) until the drain's own
   deadline, and give the taken-back handlers at least ``settle_s`` to let go; then restart the
   worker with the new args and wait for its health check;
5. dispatching resumes by itself: the restarted worker is READY again (or DOWN if it did not come
   back); a restart refused before the worker stopped sets it back to READY. With a single worker
   the proxy's queue holds the traffic meanwhile. Cancelled (the proxy stops), the rollout sets
   the worker back to READY only if its restart had not begun: a worker being stopped is the
   pool's to finish stopping, not one to announce as serving.

What the drain did comes back as a :class:`proxy.control.controller.Drain` (the journal entry's ``act``).

A worker that died (:meth:`Rollout.revive`) has nothing left to drain: the request path already
retried what had produced no output and answered the rest with an error; it is restarted at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from proxy.control.controller import ActResult, Drain
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState

__all__ = ["Drainable", "Rollout"]

_log = logging.getLogger(__name__)


class Drainable(Protocol):
    """The request path's hooks (``proxy.request.dispatch.Dispatcher``)."""

    async def wait_idle(self, worker_id: WorkerId, timeout_s: float | None = None) -> bool: ...

    def take_back(self, worker_id: WorkerId) -> int: ...

    def open_attempts(self, worker_id: WorkerId) -> int: ...


class RestartablePool(Protocol):
    def get(self, worker_id: WorkerId) -> WorkerInfo: ...

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo: ...

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo: ...


class Rollout:
    def __init__(
        self,
        pool: RestartablePool,
        dispatcher: Drainable,
        *,
        drain_timeout_s: float,
        settle_s: float = 10.0,
        drain_slices: int = 6,
        drain_progress: float = 0.1,
    ) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.drain_timeout_s = drain_timeout_s
        self.settle_s = settle_s
        self.drain_slices = max(1, drain_slices)
        self.drain_progress = drain_progress

    def _set_state(self, worker_id: WorkerId, state: WorkerState) -> None:
        try:
            self.pool.set_state(worker_id, state)
        except Exception as exc:  # the worker changed state meanwhile (it died): nothing to mark
            _log.debug("cannot mark %s %s: %s", worker_id, state, exc)

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        if self.pool.get(worker_id).state is WorkerState.READY:
            self._set_state(worker_id, WorkerState.DRAINING)
        restarting = False
        try:
            in_flight = self.dispatcher.open_attempts(worker_id)
            loop = asyncio.get_running_loop()
            started = loop.time()
            deadline = started + self.drain_timeout_s
            stopped = await self._drain(worker_id, deadline)
            drain = Drain(
                in_flight_at_drain=in_flight, drained=stopped is None, drain_s=round(loop.time() - started, 3)
            )
            if stopped is not None:
                taken_back = self.dispatcher.take_back(worker_id)
                settled = await self.dispatcher.wait_idle(worker_id, max(deadline - loop.time(), self.settle_s))
                drain = replace(
                    drain,
                    taken_back=taken_back,
                    still_running_at_restart=0 if settled else self.dispatcher.open_attempts(worker_id),
                    drain_stopped=stopped or None,
                )
            _log.info("restarting %s: %s (%s)", worker_id, reason, drain.to_json())
            restarting = True
            info = await self.pool.restart(worker_id, args, reason)
        except asyncio.CancelledError:
            # the proxy is stopping: a worker still serving takes traffic again until the pool stops
            # it; one whose restart began (its process may be on its way out) is left to the pool
            if not restarting and self.pool.get(worker_id).state is WorkerState.DRAINING:
                self._set_state(worker_id, WorkerState.READY)
            raise
        except Exception:  # refused before the worker stopped (bad args...): it serves on as it was
            if self.pool.get(worker_id).state is WorkerState.DRAINING:
                self._set_state(worker_id, WorkerState.READY)
            raise
        return ActResult(info=info, drain=drain)

    async def _drain(self, worker_id: WorkerId, deadline: float) -> str | None:
        """Wait for the worker to go idle, slice by slice, while its requests keep finishing.

        Returns ``None`` when it went idle, else why the drain ended: the slice that saw too few
        finish, or "" when the deadline came first."""
        loop = asyncio.get_running_loop()
        step = self.drain_timeout_s / self.drain_slices
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return ""
            before = self.dispatcher.open_attempts(worker_id)
            if await self.dispatcher.wait_idle(worker_id, min(step, left)):
                return None
            after = self.dispatcher.open_attempts(worker_id)
            if before - after < self.drain_progress * before:
                return f"{before - after} of {before} finished in {step:g} s"

    async def revive(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        _log.info("reviving %s: %s", worker_id, reason)
        info = await self.pool.restart(worker_id, args, reason)
        return ActResult(info=info)
