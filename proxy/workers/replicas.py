"""Several proxy replicas, one fleet: one leads the workers, the others follow its roster.

With ``[store] url`` every replica runs a :class:`ReplicaPool`. Every :data:`POLL_S` it stamps itself
alive, takes or renews the leader lease (:mod:`proxy.store.lease`) and, as the leader, publishes its
workers to the roster (:mod:`proxy.store.roster`); a follower reads the roster instead.

- The leader owns a supervisor (``make_pool``): it starts, adopts, restarts and stops the workers,
  and runs what ``leading`` gives (the controllers) while it leads. A state change of its workers is
  published at once.
- A follower serves the same workers from the roster (:class:`~proxy.workers.followed.FollowedPool`)
  and restarts nothing.
- Fencing: the leader acts only in its term. Its roster is written only while the store says it holds
  the lease in that term; its restarts are refused once its lease ran out unrenewed; each worker's
  lease file names the term it was written in, and a later term's leader adopts the worker whether or
  not the earlier one still runs (:func:`~proxy.workers.adopt.held_elsewhere`), while the earlier one
  writes it no more.
- When the leader dies, the first replica to find its lease run out leads next: its supervisor adopts
  the workers (the same processes), and until it has, the replica goes on serving the roster.
- A leader that stops hands over: it leaves the workers running and gives the lease up at once;
  the last replica standing stops them as a single proxy does.
- Each replica learns how many replicas are alive (``replicas``): the pacing divides the room in the
  band by it (:meth:`~proxy.request.pacing.LoadBoard.set_replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from proxy.store import Lease, open_database
from proxy.store.roster import LEADER, Roster
from proxy.store.thread import StoreThread
from proxy.workers.base import (
    LaunchPlanner,
    LineListener,
    StateListener,
    WorkerId,
    WorkerInfo,
    WorkerPool,
    WorkerState,
    tell_listeners,
)
from proxy.workers.followed import FollowedPool, record_of
from proxy.workers.lease import owner

__all__ = ["LEADER_LEASE_S", "POLL_S", "ReplicaPool", "Tick"]

_log = logging.getLogger(__name__)

# How often a replica looks at the store: it stamps itself alive, takes or renews the leader lease, and
# publishes (the leader) or reads (a follower) the roster. A look is a few statements, a few milliseconds
# on a PostgreSQL server in the same network: a second costs the server next to nothing per replica, and
# keeps a follower's view of the workers at most a second behind the leader's.
POLL_S = 1.0
# How long the leader's lease lasts unrenewed. Issue 45 wants a new leader within 15 s of the old one's
# death: the first replica to look after the lease ran out takes it, at most LEADER_LEASE_S + POLL_S
# (11 s) after the last renewal, which leaves room for a slow look. Ten renewals in a row must fail
# before a live leader loses it, so a store that restarts or fails over in a few seconds changes no leader.
LEADER_LEASE_S = 10.0

Fence = Callable[[], int | None]
Leading = Callable[[], AbstractAsyncContextManager[None]]


class LeaderPool(WorkerPool, Protocol):
    """The supervisor (or fleet of them) the leader runs."""

    async def stop(self, *, leave: bool = False) -> None: ...

    def add_line_listener(self, listener: LineListener) -> None: ...

    def plan_launches(self, planner: LaunchPlanner) -> None: ...

    def tail(self, worker_id: WorkerId, n: int = 50) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Tick:
    """What one look at the store found: the lease, the roster (read by a follower), the live replicas."""

    holder: str
    term: int
    expires_at: float
    leading: bool
    records: tuple[Mapping[str, Any], ...]
    live: int
    published: bool


class _Store:
    """The replica's side of the store, on a connection of its own; its methods block."""

    def __init__(self, url: str, data_dir: Path, replica: str, lease_s: float) -> None:
        self._db = open_database(url, data_dir, "fleet.sqlite3")
        self._lease = Lease(self._db, LEADER, replica, duration_s=lease_s)
        self._roster = Roster(self._db)
        self._replica = replica
        self._lease_s = lease_s

    def tick(self, records: Sequence[Mapping[str, Any]] | None) -> Tick:
        me = owner()
        self._roster.beat(self._replica, {"host": me["host"], "pid": me["pid"]})
        state = self._lease.acquire()
        leading = state.holder == self._replica
        published = leading and records is not None and self._roster.publish(self._replica, state.term, records)
        read = () if leading else tuple(entry.record for entry in self._roster.read())
        live = self._roster.live(self._lease_s)
        return Tick(state.holder, state.term, state.expires_at, leading, read, live, published)

    def leave(self) -> None:
        self._lease.release()
        self._roster.leave(self._replica)

    def close(self) -> None:
        self._db.close()


class ReplicaPool:
    """Implements :class:`~proxy.workers.base.WorkerPool`, ``WorkerLogs`` and ``PlannedLaunches``: the
    leader's supervisor while this replica leads and has taken the workers over, else the roster.
    The proxy runs it with :data:`LEADER_LEASE_S` and :data:`POLL_S`; a test may pass shorter ones."""

    def __init__(
        self,
        make_pool: Callable[[Fence], LeaderPool],
        *,
        url: str,
        data_dir: Path,
        lease_s: float = LEADER_LEASE_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
        replica: str | None = None,
    ) -> None:
        if lease_s < 2 * poll_s:  # the leader renews its lease each poll: one late look must not lose it
            raise ValueError(f"lease_s ({lease_s:g} s) must be at least twice poll_s ({poll_s:g} s)")
        self.replica = replica or str(owner()["id"])  # this process's, as its workers' leases name it
        self._make_pool = make_pool
        self._store_args = (url, data_dir, self.replica, lease_s)
        self._poll_s = poll_s
        self._clock = clock
        self._followed = FollowedPool(local_hold_s=2 * poll_s)
        self._followed.add_listener(self._from_followed)
        self._leader: LeaderPool | None = None
        self._active: WorkerPool = self._followed
        self._listeners: list[StateListener] = []
        self._line_listeners: list[LineListener] = []
        self._planner: LaunchPlanner | None = None
        self._leading: Leading | None = None
        self._on_replicas: Callable[[int], None] | None = None
        self._term: int | None = None
        self._expires = 0.0
        self._last: Tick | None = None
        self._store: _Store | None = None
        self._thread: StoreThread | None = None  # the store's calls, one at a time
        self._wake = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        self._taking: asyncio.Task[None] | None = None
        self._lead_stack: AsyncExitStack | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def follow_with(self, *, leading: Leading, replicas: Callable[[int], None]) -> None:
        """``leading`` runs while this replica leads (the controllers); ``replicas`` hears the live count."""
        self._leading, self._on_replicas = leading, replicas

    def fence(self) -> int | None:
        """The term this replica leads in, while its lease has not run out (else None)."""
        return self._term if self._term is not None and self._clock() < self._expires else None

    def role(self) -> dict[str, Any]:
        """This replica as ``/admin/workers`` shows it."""
        last = self._last
        return {
            "id": self.replica,
            "leader": self._term is not None,
            "serving": "leader" if self._active is not self._followed else "roster",
            "term": None if last is None else last.term,
            "holder": None if last is None else last.holder,
            "replicas": None if last is None else last.live,
        }

    # ------------------------------------------------------------------ WorkerPool: reading

    def workers(self) -> Sequence[WorkerInfo]:
        return self._active.workers()

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return self._active.get(worker_id)

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def add_line_listener(self, listener: LineListener) -> None:
        self._line_listeners.append(listener)
        if self._leader is not None:
            self._leader.add_line_listener(listener)

    def plan_launches(self, planner: LaunchPlanner) -> None:
        self._planner = planner
        if self._leader is not None:
            self._leader.plan_launches(planner)

    def tail(self, worker_id: WorkerId, n: int = 50) -> list[str]:
        return self._leader.tail(worker_id, n) if self._leader is not None else []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the store, look once (lead or follow), then go on looking every ``poll_s``."""
        self._thread = StoreThread("replica-store")
        self._store = await self._thread.call(_Store, *self._store_args)
        await self._tick()
        self._run_task = asyncio.create_task(self._run(), name="pacer-replica")

    async def stop(self) -> None:
        """Stop looking; a leader leaves its workers to the other replicas (or stops them when none is
        left) and gives the lease up."""
        for task in (self._run_task, self._taking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        leader, self._leader = self._leader, None
        if leader is not None:
            others = (self._last.live if self._last is not None else 1) - 1
            if self._lead_stack is not None:
                await self._lead_stack.aclose()
            await leader.stop(leave=others > 0)
            _log.info("replica %s stops leading: %s", self.replica, "handed over" if others > 0 else "the last one")
        self._term = None
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._store is not None:
            store, self._store = self._store, None
            with contextlib.suppress(Exception):  # after a look cancelled above has ended on the thread
                await thread.call(store.leave)
            await thread.call(store.close)
        thread.shutdown()

    # ------------------------------------------------------------------ WorkerPool: acting

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        return await self._acting(worker_id).restart(worker_id, args, reason)

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        return self._active.set_state(worker_id, state)

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        return self._active.hold(worker_id)

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        self._active.report_unreachable(worker_id, error)

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        self._acting(worker_id).declare_down(worker_id, why, for_good=for_good)

    def _acting(self, worker_id: WorkerId) -> WorkerPool:
        """Who acts on ``worker_id``: the leader's supervisor in the current term, else the roster
        (which refuses)."""
        from proxy.workers.supervisor import WorkerError

        if self._leader is not None and self._active is self._leader:
            if self.fence() is None:
                raise WorkerError(f"worker {worker_id}: this replica's leader lease ran out unrenewed")
            return self._leader
        return self._followed

    # ------------------------------------------------------------------ the store

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            self._wake.clear()
            try:
                await self._tick()
            except Exception as exc:  # the store is away: serve on as we are, look again
                _log.warning("replica %s: the store did not answer: %s", self.replica, exc)

    async def _tick(self) -> None:
        assert self._store is not None
        leader = self._leader
        records = [record_of(w) for w in leader.workers()] if leader is not None and self._active is leader else None
        assert self._thread is not None
        tick = await self._thread.call(self._store.tick, records)
        self._last = tick
        if self._on_replicas is not None:
            self._on_replicas(tick.live)
        if tick.leading:
            self._term, self._expires = tick.term, tick.expires_at
            if self._leader is None:
                self._take_lead(tick)
        elif self._leader is not None:
            await self._step_down(f"replica {tick.holder} leads in term {tick.term}")
        if self._leader is None:
            self._followed.apply(tick.records)

    # ------------------------------------------------------------------ leading

    def _take_lead(self, tick: Tick) -> None:
        """Lead from now on: a supervisor of our own takes the workers over, in the background (the
        lease is renewed meanwhile); until it has, the roster is served."""
        _log.warning("replica %s leads the workers (term %d)", self.replica, tick.term)
        leader = self._make_pool(lambda: self._term)
        leader.add_listener(self._from_leader)
        for listener in self._line_listeners:
            leader.add_line_listener(listener)
        self._leader = leader
        self._taking = asyncio.create_task(self._take_over(leader), name="pacer-take-over")

    async def _take_over(self, leader: LeaderPool) -> None:
        stack = AsyncExitStack()
        self._lead_stack = stack
        if self._leading is not None:
            try:
                await stack.enter_async_context(self._leading())  # the controllers plan launches here
            except Exception:
                _log.exception("replica %s: starting the controllers failed: it leads without them", self.replica)
        if self._planner is not None:
            leader.plan_launches(self._planner)
        fresh = not self._followed.workers()  # nobody led before: serve the workers as they come up
        if fresh:
            self._switch(leader)
        try:
            await leader.start()
        except Exception:
            _log.exception("replica %s: taking the workers over failed", self.replica)
        if not fresh and self._leader is leader:
            self._switch(leader)
            self._wake.set()  # publish what it adopted
        _log.info("replica %s serves the workers it leads (term %s)", self.replica, self._term)

    async def _step_down(self, why: str) -> None:
        """Another replica leads now: stop acting, leave the workers running, serve the roster."""
        _log.warning("replica %s no longer leads: %s", self.replica, why)
        leader, self._leader = self._leader, None
        self._term = None
        if self._taking is not None:
            self._taking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._taking
        self._switch(self._followed)
        if self._lead_stack is not None:
            await self._lead_stack.aclose()
            self._lead_stack = None
        if leader is not None:
            await leader.stop(leave=True)

    def _switch(self, pool: WorkerPool) -> None:
        """Serve ``pool`` from now on: every listener hears each of its workers."""
        self._active = pool
        for info in pool.workers():
            self._tell(info)

    def _from_leader(self, info: WorkerInfo) -> None:
        if self._leader is not None and self._active is self._leader:
            self._tell(info)
            self._wake.set()  # published at once

    def _from_followed(self, info: WorkerInfo) -> None:
        if self._active is self._followed:
            self._tell(info)

    def _tell(self, info: WorkerInfo) -> None:
        tell_listeners(self._listeners, info, self._tasks)
