"""The planner's process: a plan computed there is the one computed here, the loop keeps the
interpreter's lock while it computes, a process that dies costs that plan only, and leaving stops it."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import pytest

from proxy.control.offload import NICENESS, PlanProcess, PlanProcessDied
from proxy.control.planner import run_plan
from proxy.policy import ControlMode
from tests.harness.processes import pid_alive
from tests.harness.wait import wait_until

from .test_controller import RecordingActor, controller, info
from .test_planner_controller import ARGS, Requests, _backlog_of_short_answers, _serve


def _pid(_: object) -> int:
    return os.getpid()


def _scheduling(_: object) -> tuple[int | None, int]:
    """The scheduling class (None where the platform has none to read) and niceness."""
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    return policy, os.getpriority(os.PRIO_PROCESS, 0)


def _cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has used (Linux: user and system, from its stat line)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy(seconds: float) -> int:
    """Pure Python for ``seconds``: what a plan's replays are to the interpreter."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


async def test_a_plan_computed_in_the_planners_process_is_the_one_computed_here(tmp_path) -> None:
    requests = _backlog_of_short_answers()
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor(), around=Requests(requests))
    c.track(info(args=ARGS))
    _serve(c, clock, requests, 0.0)
    (job,) = c.plans_due()
    async with PlanProcess() as planning:
        assert planning.pids == ()  # started by the first plan, not before
        there = await planning(run_plan, job.inputs)
        (pid,) = planning.pids
        assert pid != os.getpid() and await planning(_pid, None) == pid  # one process, each call in turn
        policy, niceness = await planning(_scheduling, None)  # it takes CPU time nothing else wants
        if hasattr(os, "SCHED_IDLE"):
            assert policy == os.SCHED_IDLE
        else:
            assert niceness == min(_scheduling(None)[1] + NICENESS, 19)
    assert there == run_plan(job.inputs)
    assert not pid_alive(pid)  # leaving stops it


async def test_the_loop_keeps_turning_while_the_process_computes() -> None:
    """A thread computing beside the loop holds the interpreter's lock for a switch interval at a
    time; the process does not share it. What the loop waits for a timer while each computes."""

    async def late_wakeups(compute: asyncio.Future[int]) -> float:
        late: list[float] = []
        while not compute.done():
            t = time.perf_counter()
            await asyncio.sleep(0.001)  # real time on purpose: how late the loop wakes is what is measured
            late.append(time.perf_counter() - t - 0.001)
        await compute
        return statistics.median(late)

    async with PlanProcess() as planning:
        await planning(_pid, None)  # started: its spawn is not what is measured
        apart = await late_wakeups(asyncio.ensure_future(planning(_busy, 1.0)))
    beside = await late_wakeups(asyncio.ensure_future(asyncio.to_thread(_busy, 1.0)))
    print(f"median late wake-up: {apart * 1e3:.2f} ms beside the process, {beside * 1e3:.2f} ms beside a thread")
    assert apart < beside / 2


async def test_a_process_that_dies_costs_its_computation_and_the_next_starts_another() -> None:
    async with PlanProcess() as planning:
        first = await planning(_pid, None)
        with pytest.raises(PlanProcessDied, match="_exit"):
            await planning(os._exit, 3)  # killed mid-plan, as the kernel's OOM killer would
        assert not pid_alive(first)
        second = await planning(_pid, None)
        assert second != first
    assert not pid_alive(second)
    with pytest.raises(RuntimeError, match="stopped"):
        await planning(_pid, None)


async def test_leaving_stops_a_computation_in_flight() -> None:
    async with PlanProcess() as planning:
        pid = await planning(_pid, None)
        idle = _cpu_seconds(pid)
        computing = asyncio.ensure_future(planning(_busy, 60.0))
        await wait_until(lambda: _cpu_seconds(pid) >= idle + 0.05, "the computation under way")
        started = time.perf_counter()
    assert time.perf_counter() - started < 10 and not pid_alive(pid)
    computing.cancel()
    with pytest.raises((asyncio.CancelledError, PlanProcessDied)):
        await computing


async def test_the_controller_decides_a_plan_computed_in_the_planners_process(tmp_path) -> None:
    requests = _backlog_of_short_answers()
    async with PlanProcess() as planning:
        c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor(), around=Requests(requests), offload=planning,
                              plan_horizon_s=5.0, plan_horizon_max_s=5.0, interval_s=0.01)  # fmt: skip
        c.track(info(args=ARGS))
        _serve(c, clock, requests, 0.0)
        task = asyncio.create_task(c.run())
        try:
            await wait_until(c.journal.entries, "the plan decided", timeout=60)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    (note,) = c.journal.entries()
    assert note["status"] == "noted" and "does not pay" in note["detail"] and planning.pids == ()
