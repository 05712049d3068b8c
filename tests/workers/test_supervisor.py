"""The supervisor with real processes on real ports (tests/workers/fake_worker.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from proxy.workers.base import WorkerInfo, WorkerState
from proxy.workers.supervisor import Supervisor, WorkerError, free_port
from tests.harness.wait import wait_until

from .conftest import FAKE_WORKER, alive, engine_settings


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.json()


async def test_two_workers_start_log_live_crash_restart_and_stop(make_supervisor, tmp_path: Path) -> None:
    sup: Supervisor = make_supervisor(
        workers=2,
        args={"max_running_requests": 8},
        extra_args=["--fake-startup-seconds", "0.5", "--fake-spawn-child"],
    )
    seen: list[WorkerInfo] = []
    sup.add_listener(seen.append)
    heard: list[tuple[str, str]] = []
    sup.add_line_listener(lambda wid, line: heard.append((wid, line)))

    await sup.start()

    w0, w1 = sup.workers()
    assert (w0.state, w1.state) == (WorkerState.READY, WorkerState.READY)
    assert w0.url != w1.url and w0.pid and w1.pid and alive(w0.pid) and alive(w1.pid)
    assert [i.state for i in seen if i.id == "w0"][:2] == [WorkerState.STARTING, WorkerState.READY]
    echoed = await get_json(f"{w0.url}/args")
    assert echoed["engine_flags"] == ["--max-running-requests", "8"]
    assert "--enable-metrics" in echoed["argv"] and w0.argv[:2] == (sys.executable, str(FAKE_WORKER))
    child_pids = [echoed["child_pid"], (await get_json(f"{w1.url}/args"))["child_pid"]]
    assert all(alive(p) for p in child_pids)

    # log lines: live to listeners, in the ring, and in the log file
    await wait_until(
        lambda: any(wid == "w1" and "Decode batch" in line for wid, line in heard),
        "any(wid == 'w1' and 'Decode batch' in line for wid, line in heard)",
    )
    assert any(wid == "w0" and "fired up" in line for wid, line in heard)
    assert any("starting on port" in line for line in sup.tail("w0", 100))
    log_text = Path(w0.log_path or "").read_text()
    assert "pacer: start: worker w0" in log_text and "fired up" in log_text

    # a worker that dies is DOWN, with what it said last
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            await s.post(f"{w1.url}/crash", timeout=aiohttp.ClientTimeout(total=5))
    await wait_until(lambda: sup.get("w1").state == WorkerState.DOWN, "sup.get('w1').state == WorkerState.DOWN")
    down = sup.get("w1")
    assert down.exit_code == 3 and down.pid is None
    assert down.last_error is not None and "code 3" in down.last_error and "crash requested" in down.last_error
    assert sup.get("w0").state == WorkerState.READY  # the other one is untouched
    await wait_until(
        lambda: not alive(child_pids[1]), "not alive(child_pids[1])"
    )  # its child went with its process group

    # kill -9 the other: DOWN too
    os.kill(w0.pid, signal.SIGKILL)
    await wait_until(lambda: sup.get("w0").state == WorkerState.DOWN, "sup.get('w0').state == WorkerState.DOWN")
    assert "SIGKILL" in (sup.get("w0").last_error or "") and sup.get("w0").exit_code == -9

    # restart with new args: same port, new argv, READY
    info = await sup.restart("w1", {"max_running_requests": 4, "schedule_conservativeness": 0.3}, "too conservative")
    assert info.state == WorkerState.READY and info.url == w1.url and info.restarts == 1
    assert info.last_error is None and info.args == {"max_running_requests": 4, "schedule_conservativeness": 0.3}
    assert "--schedule-conservativeness" in info.argv
    echoed = await get_json(f"{info.url}/args")
    assert echoed["engine_flags"] == ["--max-running-requests", "4", "--schedule-conservativeness", "0.3"]
    assert "restart: too conservative" in Path(info.log_path or "").read_text()

    pids = [info.pid, echoed["child_pid"]]
    await sup.stop()
    assert all(i.state == WorkerState.STOPPED and i.pid is None for i in sup.workers())
    for pid in pids:
        await wait_until(lambda pid=pid: not alive(pid), f"pid {pid} gone")


async def test_drain_hook(make_supervisor) -> None:
    sup = make_supervisor()
    await sup.start()
    states: list[WorkerState] = []

    async def listener(info: WorkerInfo) -> None:  # coroutine listeners work too
        states.append(info.state)

    sup.add_listener(listener)
    assert sup.set_state("w0", WorkerState.DRAINING).state == WorkerState.DRAINING
    assert sup.set_state("w0", WorkerState.READY).state == WorkerState.READY
    with pytest.raises(WorkerError, match="cannot set it to stopped"):
        sup.set_state("w0", WorkerState.STOPPED)
    with pytest.raises(WorkerError, match="no worker 'w9'"):
        sup.get("w9")
    await wait_until(
        lambda: states == [WorkerState.DRAINING, WorkerState.READY],
        "states == [WorkerState.DRAINING, WorkerState.READY]",
    )


async def test_ready_line_ends_the_health_wait_before_the_next_poll(tmp_path: Path) -> None:
    """The engine's ready line wakes the health wait: with a poll an hour apart (and a start-up
    deadline of ten minutes) the worker is READY as soon as it serves, not at the poll after (the
    fake worker logs SGLang's ready line once it listens). No clock decides it: without the line
    the first /health after the refused one would come past the test's own time-out."""
    sup = Supervisor(engine_settings(tmp_path, startup_timeout_s=600.0), poll_interval_s=3600.0)
    try:
        await asyncio.wait_for(sup.start(), 60.0)
        assert sup.get("w0").state == WorkerState.READY
        await asyncio.wait_for(sup.restart("w0", {}, "test"), 60.0)  # a restart too: the hint is per launch
        assert sup.get("w0").state == WorkerState.READY
    finally:
        await sup.stop()


async def test_exit_during_startup_is_down_with_its_last_lines(make_supervisor) -> None:
    sup = make_supervisor(extra_args=["--fake-exit-at-start", "7"])
    await sup.start()
    info = sup.get("w0")
    assert info.state == WorkerState.DOWN and info.exit_code == 7
    assert "Not enough memory" in (info.last_error or "")


async def test_a_second_death_is_told_by_its_own_run_not_the_first(make_supervisor) -> None:
    """The log file and the ring keep every run's lines; the cause of a death and the tail the
    controller classifies are the run that died's alone (they had repeated the first run's error)."""
    sup = make_supervisor(extra_args=["--fake-exit-at-start", "7"])
    await sup.start()
    first = sup.get("w0")
    assert first.state == WorkerState.DOWN
    assert (
        first.last_error
        == "exited with code 7: RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
    )
    info = await sup.restart("w0", {}, "again")
    assert info.state == WorkerState.DOWN and info.last_error == first.last_error
    assert len([line for line in sup.tail("w0", 100) if "starting on port" in line]) == 1
    assert Path(info.log_path or "").read_text().count("Not enough memory") == 2  # the file keeps both


async def test_startup_timeout_stops_the_process(make_supervisor) -> None:
    # the last /health before the deadline may run out of time on a loaded machine: it does not hide the 503
    # the worker answered before (a first build said "connection refused" then, and this test failed); the
    # deadline is real time that the worker's start (a Python with aiohttp) must fit on a starved CPU
    sup = make_supervisor(extra_args=["--fake-startup-seconds", "60"], startup_timeout_s=10.0)
    await sup.start()
    info = sup.get("w0")
    assert info.state == WorkerState.DOWN and "not healthy after 10 s" in (info.last_error or "")
    assert "HTTP 503" in (info.last_error or "") and info.pid is None
    assert "; it said last: " in (info.last_error or "")  # what the worker printed, to see why it hung


async def test_a_health_check_that_never_answers_in_time_says_so(make_supervisor) -> None:
    """The deadline must leave the worker time to listen (a Python start-up with aiohttp, seconds on
    a loaded machine): a worker not listening yet at the deadline is refused, not silent."""
    sup = make_supervisor(extra_args=["--fake-health-delay", "30"], startup_timeout_s=10.0)
    await sup.start()
    info = sup.get("w0")
    assert info.state == WorkerState.DOWN and info.pid is None
    assert "not healthy after 10 s (last /health: no answer within" in (info.last_error or "")


async def test_sigterm_ignored_means_sigkill_after_grace(make_supervisor) -> None:
    sup = make_supervisor(extra_args=["--fake-ignore-sigterm"], stop_grace_s=0.5)
    await sup.start()
    pid = sup.get("w0").pid
    assert pid is not None
    await sup.stop()
    assert not alive(pid) and sup.get("w0").exit_code == -signal.SIGKILL


async def test_port_clash_on_a_free_port_retries_on_another(make_supervisor, tmp_path: Path) -> None:
    marker = tmp_path / "clashed"
    sup = make_supervisor(extra_args=["--fake-clash-once", str(marker)])
    await sup.start()
    info = sup.get("w0")
    assert marker.exists() and info.state == WorkerState.READY
    assert Path(info.log_path or "").read_text().count("pacer: start: worker w0") == 2


async def test_fixed_port_in_use_is_down(make_supervisor) -> None:
    port = free_port("127.0.0.1")
    blocker = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    try:
        sup = make_supervisor(base_port=port)
        await sup.start()
        info = sup.get("w0")
        assert info.state == WorkerState.DOWN and f"port {port}" in (info.last_error or "")
        assert info.pid is None
    finally:
        blocker.close()
        await blocker.wait_closed()


async def test_missing_launcher_is_down(make_supervisor, tmp_path: Path) -> None:
    sup = make_supervisor(command=[str(tmp_path / "no-such-binary")])
    await sup.start()
    info = sup.get("w0")
    assert info.state == WorkerState.DOWN and "cannot start" in (info.last_error or "")


async def test_external_workers_are_probed_not_restarted(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE_WORKER), "--host", "127.0.0.1", "--port", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    dead_port = free_port("127.0.0.1", {port})
    settings = engine_settings(
        tmp_path,
        kind="external",
        urls=[f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dead_port}/"],
        command=None,
        **{"workers": 2},
    )
    sup = Supervisor(settings, external_probe_interval_s=0.2)
    try:
        # wait for the external server to come up before registering it
        async def healthy() -> bool:
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(healthy, "the external server's /health", every=0.1)
        await sup.start()
        up, down = sup.workers()
        assert up.state == WorkerState.READY and not up.managed and up.pid is None
        assert down.state == WorkerState.DOWN and "unreachable" in (down.last_error or "")
        assert down.url == f"http://127.0.0.1:{dead_port}"
        with pytest.raises(WorkerError, match="external"):
            await sup.restart("w0", {}, "test")
        proc.kill()
        await proc.wait()
        await wait_until(lambda: sup.get("w0").state == WorkerState.DOWN, "sup.get('w0').state == WorkerState.DOWN")
    finally:
        await sup.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_stop_during_startup_leaves_nothing(make_supervisor) -> None:
    sup = make_supervisor(workers=2, extra_args=["--fake-startup-seconds", "60", "--fake-spawn-child"])
    starting = asyncio.create_task(sup.start())
    await wait_until(
        lambda: len(sup.workers()) == 2 and all(w.pid for w in sup.workers()),
        "len(sup.workers()) == 2 and all(w.pid for w in sup.workers())",
    )
    pids = [w.pid for w in sup.workers()]
    await sup.stop()
    await asyncio.wait_for(starting, 10)
    assert all(w.state == WorkerState.STOPPED and w.pid is None for w in sup.workers())
    for pid in pids:
        assert pid is not None and not alive(pid)


async def test_vllm_workers_get_vllm_flags(make_supervisor) -> None:
    pytest.importorskip("proxy.engines.vllm.argv")
    sup = make_supervisor(kind="vllm", args={"max_num_seqs": 24})
    await sup.start()
    info = sup.get("w0")
    assert info.state == WorkerState.READY
    echoed = await get_json(f"{info.url}/args")
    assert echoed["engine_flags"] == ["--max-num-seqs", "24"] and "--enable-metrics" not in echoed["argv"]


async def test_a_worker_held_while_starting_comes_up_draining_and_its_restart_lifts_it(make_supervisor) -> None:
    """A hold while the worker starts (its start-up lines said its arguments will not do) is kept:
    once healthy it is DRAINING, so no request reaches it; its restart comes up READY."""
    sup = make_supervisor()
    held: list[str] = []

    def hold_once(worker_id: str, line: str) -> None:
        if not held and sup.get(worker_id).state is WorkerState.STARTING:
            held.append(line)
            sup.hold(worker_id)

    sup.add_line_listener(hold_once)
    await sup.start()
    assert held and sup.get("w0").state is WorkerState.DRAINING
    await sup.restart("w0", {}, "the arguments that fit")
    assert sup.get("w0").state is WorkerState.READY


async def test_the_launch_planner_sets_each_workers_first_launch_and_a_failing_one_leaves_it_as_configured(
    make_supervisor,
) -> None:
    """The planner sees each managed worker as configured before its first launch; what it returns is
    what the worker is launched with (its argv, its info). A planner that raises leaves the worker as
    configured; a restart takes the arguments it is given, not the planner's."""
    sup: Supervisor = make_supervisor(workers=2, args={"max_running_requests": 8})
    seen: list[WorkerInfo] = []

    async def planner(info: WorkerInfo) -> dict[str, object]:
        seen.append(info)
        if info.id == "w1":
            raise RuntimeError("no forecast")
        return {**info.args, "max_running_requests": 4}

    sup.plan_launches(planner)
    await sup.start()
    assert [(i.id, i.args, i.state) for i in seen] == [
        ("w0", {"max_running_requests": 8}, WorkerState.STOPPED),
        ("w1", {"max_running_requests": 8}, WorkerState.STOPPED),
    ]
    w0, w1 = sup.workers()
    assert w0.args == {"max_running_requests": 4} and (await get_json(f"{w0.url}/args"))["engine_flags"] == [
        "--max-running-requests",
        "4",
    ]
    assert w1.args == {"max_running_requests": 8} and (await get_json(f"{w1.url}/args"))["engine_flags"] == [
        "--max-running-requests",
        "8",
    ]
    info = await sup.restart("w0", {"max_running_requests": 16}, "more")
    assert info.args == {"max_running_requests": 16} and len(seen) == 2


async def test_a_worker_declared_down_is_told_after_its_death_and_its_marks_are_lifted(make_supervisor) -> None:
    """declare_down from inside a listener (the controller's, as it hears of the death) is told to
    every listener after the death itself, never before it; a crash loop's mark goes with a restart
    on other arguments, and a worker that serves is never marked."""
    sup = make_supervisor(extra_args=["--fake-exit-at-start", "7"])
    told: list[tuple[WorkerState, bool]] = []

    def controller(info: WorkerInfo) -> None:
        if info.state is WorkerState.DOWN and not info.crash_loop:
            sup.declare_down(info.id, "in a crash loop", for_good=False)

    sup.add_listener(controller)
    sup.add_listener(lambda info: told.append((info.state, info.crash_loop)))
    await sup.start()
    assert told[-2:] == [(WorkerState.DOWN, False), (WorkerState.DOWN, True)]
    assert sup.get("w0").crash_loop and sup.get("w0").last_error.endswith("; in a crash loop")  # type: ignore[union-attr]
    await sup.restart("w0", {"max_running_requests": 8}, "a rule's other arguments")
    assert sup.get("w0").state is WorkerState.DOWN and told[-1] == (WorkerState.DOWN, True)  # it loops on these
    assert (WorkerState.STARTING, False) in told[2:]  # the restart on other arguments lifted the mark
