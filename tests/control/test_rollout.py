"""The rolling restart's drain: it waits while requests finish, and takes back at once what will not.

Run on virtual time (looptime): the durations are exact, and the tests take no real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from proxy.control.constants import CONSTANTS
from proxy.control.controller import Drain
from proxy.control.rollout import Rollout
from proxy.policy import parse_policy
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState


class FakeDispatcher:
    """``open`` requests; each finishes at its time (seconds after the drain began), unless taken back.
    ``started`` ones (a stream that sent output) cannot be taken back."""

    def __init__(self, finish_at: list[float], started: int = 0) -> None:
        self.finish_at = sorted(finish_at)
        self.started = started  # the first ``started`` of finish_at cannot be taken back
        self.taken: list[float] = []

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _open(self) -> list[float]:
        now = self._now()
        return [t for t in self.finish_at if t > now and t not in self.taken]

    def open_attempts(self, worker_id: WorkerId) -> int:
        return len(self._open())

    async def wait_idle(self, worker_id: WorkerId, timeout_s: float | None = None) -> bool:
        end = self._now() + (timeout_s if timeout_s is not None else 1e9)
        while self._open():
            if self._now() >= end:
                return False
            await asyncio.sleep(min(max(self._open()), end) - self._now())
        return True

    def take_back(self, worker_id: WorkerId) -> int:
        keep = set(self.finish_at[: self.started])
        back = [t for t in self._open() if t not in keep]
        self.taken += back
        return len(back)


class FakePool:
    def __init__(self) -> None:
        self.states = [WorkerState.READY]
        self.restarted: list[Mapping[str, object]] = []

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return WorkerInfo(id=worker_id, url="http://w", state=self.states[-1], args={}, managed=True)

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        self.states.append(state)
        return self.get(worker_id)

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        self.restarted.append(args)
        self.states.append(WorkerState.READY)
        return self.get(worker_id)


async def _restart(dispatcher: FakeDispatcher, drain_timeout_s: float = 0.6) -> tuple[Drain, float]:
    pool = FakePool()
    rollout = Rollout(pool, dispatcher, drain_timeout_s=drain_timeout_s, settle_s=0.05)
    loop = asyncio.get_running_loop()
    t = loop.time()
    result = await rollout.restart("w0", {"x": 1}, "test")
    assert pool.restarted == [{"x": 1}]
    assert pool.states == [WorkerState.READY, WorkerState.DRAINING, WorkerState.READY]  # drained, restarted
    assert result.drain is not None
    return result.drain, loop.time() - t


@pytest.mark.looptime
async def test_short_outputs_drain_to_the_end() -> None:
    """Requests keep finishing: the drain waits for all of them, nothing is taken back."""
    d, took = await _restart(FakeDispatcher([0.02 * i for i in range(1, 20)]))
    assert d.drained is True and d.taken_back == 0 and d.drain_stopped is None
    assert took == pytest.approx(0.38)  # the last one finished


@pytest.mark.looptime
async def test_long_outputs_are_taken_back_after_one_slice() -> None:
    """Nothing finishes within a slice (outputs far from done): take back at once, not after the timeout."""
    d, took = await _restart(FakeDispatcher([5.0 + i for i in range(30)]))
    assert d.drained is False and d.taken_back == 30 and d.drain_stopped == "0 of 30 finished in 0.1 s"
    assert took == pytest.approx(0.1)  # one slice (0.6 / 6), not the 0.6 s timeout


@pytest.mark.looptime
async def test_the_drain_stops_when_finishing_slows_down() -> None:
    """A third finish early, the rest much later: the drain ends in the first slice that sees too few finish."""
    finish = [0.01 * i for i in range(1, 11)] + [10.0 + i for i in range(20)]
    d, took = await _restart(FakeDispatcher(finish))
    assert d.drained is False and d.taken_back == 20
    assert took == pytest.approx(0.2)  # the second slice saw none of the 20 finish


@pytest.mark.looptime
async def test_streams_with_output_are_waited_for_until_the_deadline() -> None:
    """What cannot be taken back (a stream already sending) still gets the drain's whole deadline."""
    finish = [0.45, 5.0, 6.0]  # the first one has sent output: it runs to its end at 0.45 s
    d, took = await _restart(FakeDispatcher(finish, started=1))
    assert d.taken_back == 2 and d.still_running_at_restart == 0
    assert took == pytest.approx(0.45)


@pytest.mark.looptime
async def test_the_drain_s_durations_are_the_workers_seconds() -> None:
    """Before a simulated worker at time scale 20 the drain's deadline and its wait past it for streams
    that sent output are a twentieth of the engine seconds on the wall clock: 1.5 s and 0.5 s, not 10 s."""
    from proxy.compose import _clock_rate, _rollout

    policy = parse_policy({"engine": {"kind": "sim", "args": {"sim_time_scale": 20}}})
    wall = CONSTANTS.in_wall(_clock_rate(policy.pools[0]))
    finish = [0.1 * i for i in range(1, 15)] + [50.0]  # finishing steadily until past the deadline, then one long
    pool = FakePool()
    rollout = _rollout(pool, FakeDispatcher(finish, started=len(finish)), wall)  # each has sent output
    assert (rollout.drain_timeout_s, rollout.settle_s) == (
        CONSTANTS.drain_timeout_s / 20,
        CONSTANTS.drain_settle_s / 20,
    )
    loop = asyncio.get_running_loop()
    t = loop.time()
    result = await rollout.restart("w0", {"x": 1}, "test")
    assert result.drain is not None and result.drain.taken_back == 0 and result.drain.still_running_at_restart == 1
    assert loop.time() - t == pytest.approx(1.5 + 0.5)  # the deadline, then the settle; the long stream is left
    assert pool.restarted == [{"x": 1}]


class StoppingPool(FakePool):
    """A restart that is under way (the old process on its way out) when the proxy stops."""

    def __init__(self) -> None:
        super().__init__()
        self.restart_began = asyncio.Event()

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        self.restart_began.set()
        await asyncio.sleep(3600)  # stopping the old process, then starting the new one
        raise AssertionError("unreachable")


@pytest.mark.looptime
async def test_cancelled_during_the_restart_it_leaves_the_worker_to_the_pool() -> None:
    """The proxy stops while the worker restarts: the rollout ends at once and does not announce
    the worker READY (it is being stopped; that READY also kicked the scraper as the app stopped it)."""
    pool = StoppingPool()
    rollout = Rollout(pool, FakeDispatcher([]), drain_timeout_s=0.6, settle_s=0.05)
    task = asyncio.create_task(rollout.restart("w0", {"x": 1}, "test"))
    await pool.restart_began.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert task in done and task.cancelled()
    assert pool.states == [WorkerState.READY, WorkerState.DRAINING]


@pytest.mark.looptime
async def test_cancelled_during_the_drain_the_worker_serves_again() -> None:
    """Cancelled before the restart began, the worker is untouched: it takes traffic again."""
    pool = FakePool()
    rollout = Rollout(pool, FakeDispatcher([50.0], started=1), drain_timeout_s=60.0, settle_s=0.05)
    task = asyncio.create_task(rollout.restart("w0", {"x": 1}, "test"))
    await asyncio.sleep(1.0)  # draining
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert task in done and task.cancelled()
    assert pool.states == [WorkerState.READY, WorkerState.DRAINING, WorkerState.READY]
    assert pool.restarted == []
