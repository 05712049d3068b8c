"""A worker on this host runs on a lease its watcher follows: the engine keeps its pid, group and
signals (the watcher execs it), and it stops by itself once the lease lapses, is gone or names
another launch; renewed, it runs on. Real processes, a real lease file, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from proxy.workers.base import WorkerState
from proxy.workers.lease import lease_path, proc_start, read_lease, write_lease
from proxy.workers.process import LeaseTerms, LineLog, WorkerProcess
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until
from tests.workers.conftest import engine_settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux's")

_SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[:-1]


async def _launch(tmp_path: Path, argv: list[str], ttl_s: float, launch: str = "l1") -> tuple[WorkerProcess, LineLog]:
    log = tmp_path / "w0.log"
    write_lease(lease_path(log), {"launch": launch, "ttl_s": ttl_s, "renewed": time.time()})
    lines = LineLog()
    w = await WorkerProcess.launch(
        argv, env=dict(os.environ), lines=lines, log_file=log, header="h", lease=LeaseTerms(launch, 1.0)
    )
    return w, lines


async def test_the_engine_keeps_its_command_pid_group_and_signals(tmp_path: Path) -> None:
    """The wrapper execs the command: the pid the proxy holds is the engine's, its argv as given,
    leading its own process group, SIGPIPE as a process started directly has it."""
    argv = ["sleep", "30"]  # not Python: Python would ignore SIGPIPE again at its own start
    w, _ = await _launch(tmp_path, argv, ttl_s=60.0)
    try:
        await wait_until(lambda: _cmdline(w.pid) == [a.encode() for a in argv], "the exec", timeout=20.0)
        assert os.getpgid(w.pid) == w.pid
        with open(f"/proc/{w.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1))
    finally:
        assert await w.terminate(grace_s=5.0) == -signal.SIGTERM  # its own exit, as the proxy sees it


async def test_a_command_that_cannot_run_says_so_in_its_log(tmp_path: Path) -> None:
    """Checked at launch, but a program can go (or not be one) by the time the wrapper execs it: one
    line in the worker's log and exit 127, as a shell says it."""
    script = tmp_path / "engine"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    w, lines = await _launch(tmp_path, [str(script)], ttl_s=60.0)
    assert await w.wait() == 127
    await w.drain_output(timeout=5.0)
    w.close()
    assert any(line.startswith(f"cannot start {script}:") for line in lines.tail(5)), lines.tail(5)


async def test_an_engine_whose_lease_is_not_renewed_stops_and_says_why(tmp_path: Path) -> None:
    w, lines = await _launch(tmp_path, _SLEEPER, ttl_s=0.5)
    started = time.monotonic()
    code = await asyncio.wait_for(w.wait(), timeout=15.0)
    assert code == -signal.SIGTERM and time.monotonic() - started >= 0.5
    await w.drain_output(timeout=5.0)
    w.close()
    assert any("the lease was not renewed for 0.5 s" in line for line in lines.tail(5)), lines.tail(5)


async def test_an_engine_whose_lease_names_another_launch_or_is_gone_stops(tmp_path: Path) -> None:
    # a lease of 24 s is looked at every 2 s (not 5, as 60 s would be): the test's wait holds many looks
    w, lines = await _launch(tmp_path, _SLEEPER, ttl_s=24.0)
    await wait_until(lambda: lines.tail(1) == ["up"], "the engine's first line", timeout=20.0)
    write_lease(lease_path(tmp_path / "w0.log"), {"launch": "another", "ttl_s": 24.0, "renewed": time.time()})
    assert await asyncio.wait_for(w.wait(), timeout=20.0) == -signal.SIGTERM
    await w.drain_output(timeout=5.0)
    w.close()
    assert any("names another launch" in line for line in lines.tail(5))

    w, lines = await _launch(tmp_path, _SLEEPER, ttl_s=24.0)
    await wait_until(lambda: lines.tail(1) == ["up"], "the engine's first line", timeout=20.0)
    lease_path(tmp_path / "w0.log").unlink()
    assert await asyncio.wait_for(w.wait(), timeout=20.0) == -signal.SIGTERM
    w.close()


async def test_the_supervisor_renews_its_workers_leases_and_they_run_on(tmp_path: Path) -> None:
    """A lease of 2 s renewed by its proxy: the worker runs on past many of them; the lease says
    who owns it and what it runs; a clean stop stops the worker and removes the lease. (Not shorter: a
    test process starved of a CPU for a lease's time would be a proxy gone, as the worker reads it.)"""
    sup = Supervisor(engine_settings(tmp_path), poll_interval_s=0.1, lease_ttl=2.0)
    await sup.start()
    try:
        info = sup.get("w0")
        assert info.state is WorkerState.READY and info.pid is not None
        path = lease_path(Path(info.log_path or ""))
        first = read_lease(path)
        assert first is not None
        assert (first["worker"], first["pool"], first["pid"], first["owner"]["pid"]) == (
            "w0",
            "default",
            info.pid,
            os.getpid(),
        )
        assert first["argv"] == list(info.argv) and first["url"] == info.url
        assert first["pid_start"] == proc_start(info.pid)

        def renewed_past_two_ttls() -> bool:
            lease = read_lease(path)
            return lease is not None and lease["renewed"] - first["renewed"] > 2 * 2.0

        await wait_until(renewed_past_two_ttls, "two lease times of renewals", timeout=20.0)
        assert sup.get("w0").pid == info.pid and proc_start(info.pid) is not None
    finally:
        await sup.stop()
    assert proc_start(info.pid) is None and not path.exists()
