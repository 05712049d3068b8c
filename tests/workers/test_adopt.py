"""A supervisor that starts where an earlier one left workers running adopts each one that is what
its lease claims, and only those: a process that is no longer the worker is left alone, a server
whose own info disagrees is stopped and replaced, a worker another live proxy owns is not touched.
Real worker processes (the fake worker), real leases, supervisors in this process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.workers.base import WorkerState
from proxy.workers.lease import lease_path, proc_start, read_lease, write_lease
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux's")


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this host that is no worker."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


async def _left_running(make: Callable[..., Supervisor], **engine: Any) -> tuple[int, Path]:
    """A worker started by one supervisor and left running by its stop (``keep_on_exit``)."""
    first = make(keep_on_exit=True, **engine)
    await first.start()
    info = first.get("w0")
    assert info.state is WorkerState.READY and info.pid is not None
    await first.stop()
    assert proc_start(info.pid) is not None, "keep_on_exit stopped the worker"
    return info.pid, lease_path(Path(info.log_path or ""))


async def test_a_worker_left_running_is_adopted_with_its_pid_port_and_arguments(make_supervisor) -> None:
    pid, lease = await _left_running(make_supervisor, args={"max_running_requests": 8})
    before = read_lease(lease)
    assert before is not None
    second = make_supervisor(args={"max_running_requests": 8})
    await second.start()
    info = second.get("w0")
    assert (info.state, info.pid, info.url, dict(info.args)) == (WorkerState.READY, pid, before["url"], before["args"])
    after = read_lease(lease)
    assert after is not None and after["owner"]["id"] == before["owner"]["id"]  # one owner id per process
    assert after["launch"] == before["launch"] and after["renewed"] > before["renewed"]
    await second.stop()  # a clean stop: the adopted worker goes
    assert proc_start(pid) is None and not lease.exists()
    assert "ended (adopted" not in (second.get("w0").last_error or "")


async def test_a_server_whose_own_info_disagrees_is_stopped_and_replaced(make_supervisor) -> None:
    """The port answers, the process is the lease's, but its server says it serves another port:
    not the worker launched there. It is stopped (it holds a port, maybe a GPU); a new one starts."""
    pid, _ = await _left_running(make_supervisor, extra_args=["--fake-info-port", "1"])
    second = make_supervisor(extra_args=["--fake-info-port", "1"])
    await second.start()
    info = second.get("w0")
    assert info.state is WorkerState.READY and info.pid not in (None, pid)
    assert proc_start(pid) is None


async def test_a_process_that_is_no_longer_the_worker_is_left_alone(make_supervisor) -> None:
    """The lease's pid is another process now (reused): not adopted, not signalled; a new worker
    starts, and the old one, whose lease now names another launch, stops by itself."""
    pid, lease = await _left_running(make_supervisor)
    record = read_lease(lease)
    assert record is not None
    # started after the worker, as a process that took a reused pid would be (the fixture's stranger
    # starts before it, within the same clock tick now and then)
    with contextlib.ExitStack() as stack:
        stranger = stack.enter_context(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        stack.callback(stranger.kill)
        assert proc_start(stranger.pid) > record["pid_start"]  # what a reused pid looks like: a later start
        write_lease(lease, {**record, "pid": stranger.pid})
        second = make_supervisor()
        await second.start()
        info = second.get("w0")
        assert info.state is WorkerState.READY and info.pid not in (None, pid, stranger.pid)
        assert stranger.poll() is None
        # its watcher looks every 5 s (a lease of 60), then SIGTERM: seconds, the deadline for a starved CPU
        await wait_until(lambda: proc_start(pid) is None, "the old worker stopped by its watcher")


async def test_a_worker_another_live_proxy_owns_is_not_touched(make_supervisor, stranger) -> None:
    pid, lease = await _left_running(make_supervisor)
    record = read_lease(lease)
    assert record is not None
    owner = {**record["owner"], "id": "another", "pid": stranger.pid, "pid_start": proc_start(stranger.pid)}
    write_lease(lease, {**record, "owner": owner})
    second = make_supervisor()
    await second.start()
    info = second.get("w0")
    assert info.state is WorkerState.DOWN and f"another proxy owns it (pid {stranger.pid}" in (info.last_error or "")
    assert info.stays_down  # nothing revives it: a launch would end the other proxy's worker
    assert proc_start(pid) is not None and read_lease(lease) == {**record, "owner": owner}
