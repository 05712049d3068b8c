"""Replicas over one store (:mod:`proxy.workers.replicas`), in one process with stand-in supervisors:
the first leads and publishes, the second serves its roster and restarts nothing; a leader that stops
leaves the workers running and the other leads them in the next term; a leader whose lease ran out
unrenewed acts no more."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest

from proxy.workers.base import LaunchPlanner, LineListener, StateListener, WorkerInfo, WorkerState
from proxy.workers.replicas import LEADER_LEASE_S, POLL_S, Fence, ReplicaPool
from proxy.workers.supervisor import WorkerError
from tests.harness.wait import wait_until

TEST_POLL_S = 0.05  # short values passed to the pool itself: the shipped ones are the module's constants
LEASE_S = 0.5


class StandIn:
    """A supervisor's part as the replicas see it: two workers that are READY once started."""

    def __init__(self, fence: Fence, log: list[str]) -> None:
        self.fence = fence
        self.log = log
        self.listeners: list[StateListener] = []
        self.infos = {
            wid: WorkerInfo(id=wid, url=f"http://127.0.0.1:{port}", state=WorkerState.STOPPED, managed=True, pid=port)
            for wid, port in (("w0", 40001), ("w1", 40002))
        }
        self.restarted: list[str] = []

    def workers(self) -> list[WorkerInfo]:
        return list(self.infos.values())

    def get(self, worker_id: str) -> WorkerInfo:
        return self.infos[worker_id]

    def add_listener(self, listener: StateListener) -> None:
        self.listeners.append(listener)

    def add_line_listener(self, listener: LineListener) -> None:
        pass

    def plan_launches(self, planner: LaunchPlanner) -> None:
        pass

    def tail(self, worker_id: str, n: int = 50) -> list[str]:
        return []

    async def start(self) -> None:
        self.log.append(f"start in term {self.fence()}")
        for wid, info in self.infos.items():
            self.infos[wid] = WorkerInfo(id=wid, url=info.url, state=WorkerState.READY, managed=True, pid=info.pid)
            for listener in self.listeners:
                listener(self.infos[wid])

    async def stop(self, *, leave: bool = False) -> None:
        self.log.append("leave" if leave else "stop")

    async def restart(self, worker_id: str, args: Mapping[str, object], reason: str) -> WorkerInfo:
        self.restarted.append(worker_id)
        return self.infos[worker_id]

    def set_state(self, worker_id: str, state: WorkerState) -> WorkerInfo:
        return self.infos[worker_id]

    def hold(self, worker_id: str) -> WorkerInfo:
        return self.infos[worker_id]

    def report_unreachable(self, worker_id: str, error: str) -> None:
        pass

    def declare_down(self, worker_id: str, why: str, *, for_good: bool = True) -> None:
        pass


@contextlib.asynccontextmanager
async def replica(
    tmp_path: Path, store_url: str, log: list[str], made: list[StandIn], clock: Callable[[], float] | None = None
) -> AsyncIterator[ReplicaPool]:
    def make(fence: Fence) -> StandIn:
        made.append(StandIn(fence, log))
        return made[-1]

    pool = ReplicaPool(
        make,
        url=store_url,
        data_dir=tmp_path,
        lease_s=LEASE_S,
        poll_s=TEST_POLL_S,
        clock=clock or time.time,
        replica=f"replica-{id(log)}",  # two replicas in one process: each an id of its own
    )
    await pool.start()
    try:
        yield pool
    finally:
        await pool.stop()


def ready(pool: ReplicaPool) -> dict[str, int | None]:
    return {w.id: w.pid for w in pool.workers() if w.state is WorkerState.READY}


async def test_one_leads_the_other_follows_and_takes_over_when_it_stops(tmp_path: Path, store_url: str) -> None:
    log_a: list[str] = []
    log_b: list[str] = []
    made_a: list[StandIn] = []
    made_b: list[StandIn] = []
    async with replica(tmp_path, store_url, log_a, made_a) as a:
        await wait_until(lambda: len(ready(a)) == 2, "the leader serving its workers")
        assert a.role()["leader"] and log_a == ["start in term 1"]
        async with replica(tmp_path, store_url, log_b, made_b) as b:
            await wait_until(lambda: ready(b) == ready(a), "the follower serving the leader's roster")
            assert not b.role()["leader"] and not made_b  # no supervisor: it starts nothing
            with pytest.raises(WorkerError):
                await b.restart("w0", {}, "a follower restarts nothing")
            await wait_until(lambda: b.role()["replicas"] == 2 and a.role()["replicas"] == 2, "both alive")
            await a.stop()  # a leader that stops hands over: its workers stay up
            assert log_a == ["start in term 1", "leave"]
            await wait_until(lambda: b.role()["serving"] == "leader", "the other replica leading")
            assert log_b == ["start in term 2"] and ready(b) == {"w0": 40001, "w1": 40002}
            await b.restart("w0", {}, "the leader acts in its term")
            assert made_b[0].restarted == ["w0"]
        assert log_b[-1] == "stop"  # the last replica standing stops the workers


async def test_a_leader_whose_lease_ran_out_acts_no_more(tmp_path: Path, store_url: str) -> None:
    now = [time.time()]
    log: list[str] = []
    made: list[StandIn] = []
    async with replica(tmp_path, store_url, log, made, clock=lambda: now[0]) as a:
        await wait_until(lambda: a.role()["serving"] == "leader", "leading")
        assert a.fence() == 1
        now[0] += 3600.0  # its own clock says the lease it last renewed ran out (a stalled replica)
        assert a.fence() is None
        with pytest.raises(WorkerError, match="ran out"):
            await a.restart("w0", {}, "fenced")
        assert not made[0].restarted


def test_the_shipped_lease_gives_a_new_leader_within_15_s_and_survives_a_late_look(tmp_path: Path) -> None:
    """Issue 45: a new leader within 15 s of the old one's death (the lease run out, then one look)."""
    assert LEADER_LEASE_S + POLL_S <= 15.0
    assert LEADER_LEASE_S >= 2 * POLL_S
    with pytest.raises(ValueError, match="at least twice"):
        ReplicaPool(lambda fence: StandIn(fence, []), url="", data_dir=tmp_path, lease_s=0.1, poll_s=0.1)
