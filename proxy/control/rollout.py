"""Carrying out a decision on one worker without losing a request.

Rolling restart (:meth:`Rollout.restart`), one worker at a time:

1. stop dispatching to the worker: the pool marks it DRAINING;
2. let its running requests finish, up to ``drain_timeout_s``, but only while they do finish
   (watched in ``drain_slices`` slices; a slice below ``drain_progress`` ends the drain early);
3. take back what has produced no output yet: abort it upstream and put it back at the front of
   the proxy's queue, so nothing is lost and nothing reaches the client twice;
4. wait for streams that already sent output until the drain's deadline (and at least
   ``settle_s``), then restart the worker with the new args and wait for its health check;
   both durations are the controller's constants on the wall clock of the pool's workers;
5. the worker is READY again (or DOWN); a restart refused before the worker stopped, or cancelled
   before it began, sets it back to READY. With one worker the proxy's queue holds the traffic.

A reshape (:meth:`Rollout.reshape_step`) drains the workers whose GPUs the new shape's workers take,
as above, then the pool stops them and starts the new ones on their GPUs.

What the drain did comes back as a :class:`proxy.control.ports.Drain` (the journal entry's
``act``). A worker that died (:meth:`Rollout.revive`) has nothing left to drain: the request path
already handled its requests, so it is restarted at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, cast

from proxy.control.ports import ActResult, Drain
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState

__all__ = ["Drainable", "ReshapablePool", "RestartablePool", "Rollout"]

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


class ReshapablePool(RestartablePool, Protocol):
    async def replace_workers(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> list[WorkerInfo]: ...


class Rollout:
    def __init__(
        self,
        pool: RestartablePool,
        dispatcher: Drainable,
        *,
        drain_timeout_s: float,
        settle_s: float,
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

    async def _drained(self, worker_id: WorkerId) -> Drain:
        """Steps 2-4 on a DRAINING worker: what it runs finishes or is taken back."""
        in_flight = self.dispatcher.open_attempts(worker_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.drain_timeout_s
        stopped = await self._drain(worker_id, deadline)
        drain = Drain(in_flight_at_drain=in_flight, drained=stopped is None, drain_s=round(loop.time() - started, 3))
        if stopped is not None:
            taken_back = self.dispatcher.take_back(worker_id)
            settled = await self.dispatcher.wait_idle(worker_id, max(deadline - loop.time(), self.settle_s))
            drain = replace(
                drain,
                taken_back=taken_back,
                still_running_at_restart=0 if settled else self.dispatcher.open_attempts(worker_id),
                drain_stopped=stopped or None,
            )
        return drain

    def gpus_of(self, worker_id: WorkerId) -> tuple[int, ...]:
        return self.pool.get(worker_id).gpus

    async def reshape_step(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> tuple[list[WorkerInfo], list[Drain]]:
        """A reshape's step: drain the ``old`` workers together (nothing more is sent to them, what they
        run finishes or is taken back into the proxy's queue, as for a restart), then the pool starts
        ``count`` workers with ``args`` on their GPUs (``ReshapablePool.replace_workers``). A step
        refused before the old ones stopped, or cancelled, sets them back to READY."""
        pool = cast("ReshapablePool", self.pool)
        for worker_id in old:
            if self.pool.get(worker_id).state is WorkerState.READY:
                self._set_state(worker_id, WorkerState.DRAINING)
        replacing = False
        try:
            drains = list(await asyncio.gather(*(self._drained(worker_id) for worker_id in old)))
            _log.info("reshaping %s into %d workers: %s", ", ".join(old), count, reason)
            replacing = True
            infos = await pool.replace_workers(old, count, args, reason)
        except BaseException:
            if not replacing:
                for worker_id in old:
                    if self.pool.get(worker_id).state is WorkerState.DRAINING:
                        self._set_state(worker_id, WorkerState.READY)
            raise
        return infos, drains

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        if self.pool.get(worker_id).state is WorkerState.READY:
            self._set_state(worker_id, WorkerState.DRAINING)
        restarting = False
        try:
            drain = await self._drained(worker_id)
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
