"""Several pools of workers behind one :class:`~proxy.workers.base.WorkerPool`.

    fleet = build_pool(policy, placement)        # one Supervisor per pool, or the Supervisor itself
    fleet.workers()                              # every pool's workers; WorkerInfo.pool says whose

The policy's pools each get a supervisor (:class:`~proxy.workers.supervisor.Supervisor` with its
:class:`~proxy.workers.slot.Placement`: pool name, model, each worker's GPUs and the engine's
placement flags). :class:`Fleet` routes each call by worker id to the supervisor that owns the
worker (ids are unique across pools: ``<pool>-w<i>``); listeners hear every pool. A policy with one
``[engine]`` table gets its supervisor alone, exactly as before pools existed.

:class:`PoolView` is one pool's part of any pool (its workers only), for what acts per pool: a
dispatcher, a rollout, a controller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from proxy.workers.base import LaunchPlanner, LineListener, StateListener, WorkerId, WorkerInfo, WorkerPool, WorkerState
from proxy.workers.process import Launcher
from proxy.workers.slot import Placement
from proxy.workers.supervisor import Supervisor, WorkerError

if TYPE_CHECKING:
    from proxy.policy import Policy, PoolSettings

__all__ = ["Fleet", "PoolView", "build_pool", "placement_of"]


def placement_of(pool: PoolSettings, gpus: tuple[tuple[int, ...], ...], *, cluster: bool = False) -> Placement:
    """What the policy's ``pool`` adds to its workers, given the GPUs each got here
    (``Policy.placement``); on a ``cluster`` its accounting picks them (``gpus = "auto"``: tp each)."""
    if pool.shorthand:  # the [engine] table: ids and arguments as they always were
        return Placement(pool=pool.name, model=pool.model, gpus=gpus)
    engine = pool.engine
    args = engine.engine.placement_args(pool.tp, pool.model) if engine.managed else {}
    n = engine.workers if engine.managed else len(engine.urls)
    return Placement(
        pool=pool.name,
        model=pool.model,
        gpus=gpus,
        args=args,
        worker_ids=tuple(pool.worker_id(i) for i in range(n)),
        num_gpus=pool.tp if cluster and pool.auto_gpus else 0,
        id_prefix=f"{pool.name}-w",
    )


def build_pool(
    policy: Policy,
    gpus: Mapping[str, tuple[tuple[int, ...], ...]],
    launcher: Launcher | None = None,
    *,
    fence: Callable[[], int | None] | None = None,
) -> Supervisor | Fleet:
    """One supervisor per pool of ``policy``; ``gpus``: each pool's GPU ids per worker on this host;
    ``launcher``: where the workers run (None: this host); ``fence``: the replicas' term this proxy
    leads in (None while it does not: :mod:`proxy.workers.replicas`)."""
    cluster = launcher is not None and not launcher.local
    members = [
        Supervisor(
            p.engine,
            placement=placement_of(p, gpus.get(p.name, ()), cluster=cluster),
            launcher=launcher,
            fence=fence,
        )
        for p in policy.pools
    ]
    return members[0] if len(members) == 1 else Fleet(members)


class Fleet:
    """Implements :class:`~proxy.workers.base.WorkerPool`, :class:`~proxy.workers.base.WorkerLogs` and
    :class:`~proxy.workers.base.PlannedLaunches` over one supervisor per pool."""

    def __init__(self, members: Sequence[Supervisor]) -> None:
        self._members = list(members)
        self._owner: dict[WorkerId, Supervisor] = {}
        for member in self._members:
            for worker_id in member.worker_ids():
                if worker_id in self._owner:
                    raise WorkerError(f"worker id {worker_id} is in two pools")
                self._owner[worker_id] = member

    def _of(self, worker_id: WorkerId) -> Supervisor:
        try:
            return self._owner[worker_id]
        except KeyError:
            raise WorkerError(f"no worker {worker_id!r}") from None

    # -- reading
    def workers(self) -> list[WorkerInfo]:
        return [w for member in self._members for w in member.workers()]

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return self._of(worker_id).get(worker_id)

    def add_listener(self, listener: StateListener) -> None:
        for member in self._members:
            member.add_listener(listener)

    def add_line_listener(self, listener: LineListener) -> None:
        for member in self._members:
            member.add_line_listener(listener)

    def plan_launches(self, planner: LaunchPlanner) -> None:
        for member in self._members:
            member.plan_launches(planner)

    def tail(self, worker_id: WorkerId, n: int = 50) -> list[str]:
        return self._of(worker_id).tail(worker_id, n)

    # -- lifecycle: every pool at once
    async def start(self) -> None:
        await asyncio.gather(*(member.start() for member in self._members))

    async def stop(self, *, leave: bool = False) -> None:
        await asyncio.gather(*(member.stop(leave=leave) for member in self._members))

    # -- one worker: its own pool's supervisor
    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        return await self._of(worker_id).restart(worker_id, args, reason)

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        return self._of(worker_id).set_state(worker_id, state)

    async def replace_workers(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> list[WorkerInfo]:
        """A reshape's step within one pool (:meth:`Supervisor.replace_workers`)."""
        owners = {self._of(worker_id) for worker_id in old}
        if len(owners) != 1:
            raise WorkerError("a reshape replaces workers of one pool")
        member = owners.pop()
        for worker_id in old:
            del self._owner[worker_id]
        try:
            infos = await member.replace_workers(old, count, args, reason)
        finally:
            for info in member.workers():
                self._owner[info.id] = member
        return infos

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        return self._of(worker_id).hold(worker_id)

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        self._of(worker_id).report_unreachable(worker_id, error)

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        self._of(worker_id).declare_down(worker_id, why, for_good=for_good)


class PoolView:
    """The workers of one pool of ``whole``; calls about a worker go to ``whole``."""

    def __init__(self, whole: WorkerPool, pool: str) -> None:
        self.whole = whole
        self.pool = pool

    def workers(self) -> list[WorkerInfo]:
        return [w for w in self.whole.workers() if w.pool == self.pool]

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return self.whole.get(worker_id)

    def add_listener(self, listener: StateListener) -> None:
        pool = self.pool

        def mine(info: WorkerInfo) -> object:
            return listener(info) if info.pool == pool else None

        self.whole.add_listener(mine)  # type: ignore[arg-type]

    async def start(self) -> None:
        raise WorkerError("a pool view does not start workers (the whole pool does)")

    async def stop(self) -> None:
        raise WorkerError("a pool view does not stop workers (the whole pool does)")

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        return await self.whole.restart(worker_id, args, reason)

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        return self.whole.set_state(worker_id, state)

    async def replace_workers(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> list[WorkerInfo]:
        replace = getattr(self.whole, "replace_workers", None)
        if replace is None:
            raise WorkerError("this pool cannot be reshaped")
        infos: list[WorkerInfo] = await replace(old, count, args, reason)
        return infos

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        return self.whole.hold(worker_id)

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        self.whole.report_unreachable(worker_id, error)

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        self.whole.declare_down(worker_id, why, for_good=for_good)
