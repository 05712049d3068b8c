"""A worker dies with the process that launched it, even when that process is killed outright (a
SIGKILL leaves it no chance to stop its workers): an engine left running would hold its GPU memory
and its port, and the proxy started again would launch a second one beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.workers.die_with_parent import guarded, resolve
from proxy.workers.process import LineLog, WorkerProcess
from tests.harness.wait import wait_until, wait_until_blocking

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# A parent that launches a sleeping worker the way the proxy does, says its pid, and waits to be killed.
_PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from proxy.workers.process import LineLog, WorkerProcess

    async def main() -> None:
        sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
        w = await WorkerProcess.launch(sleeper, env={}, lines=LineLog(), log_file=Path(sys.argv[1]), header="h")
        print(w.pid, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone for our purpose
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[:-1]


def test_a_worker_ends_when_its_launcher_is_killed_outright(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "w.log")], stdout=subprocess.PIPE, text=True
    )
    worker = 0
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        log = tmp_path / "w.log"
        # the guard set the parent-death signal before it exec'd the worker, which then printed
        wait_until_blocking(lambda: "up" in log.read_text().split(), "the worker's first line", detail=log.read_text)
        assert _alive(worker), "the worker did not start"
        parent.kill()
        parent.wait()
        wait_until_blocking(lambda: not _alive(worker), "the worker to end with the process that launched it")
    finally:
        parent.kill()
        parent.wait()
        if worker and _alive(worker):
            os.killpg(worker, 9)


async def test_the_worker_keeps_its_command_pid_and_group(tmp_path: Path) -> None:
    """The guard execs the command: the pid the launcher holds is the engine's, its argv as given,
    and it leads its own process group (what stopping a worker signals)."""
    argv = ["sleep", "30"]  # not Python: Python would ignore SIGPIPE again at its own start
    w = await WorkerProcess.launch(argv, env={}, lines=LineLog(), log_file=tmp_path / "w.log", header="h")
    try:
        # the guard execs the command once it has started
        await wait_until(lambda: _cmdline(w.pid) == [a.encode() for a in argv], "the guard to exec the command")
        assert os.getpgid(w.pid) == w.pid
        with open(f"/proc/{w.pid}/status") as f:  # SIGPIPE as a process started directly has it
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1))
    finally:
        await w.terminate(grace_s=5.0)


async def test_a_command_that_cannot_run_says_so_in_its_log(tmp_path: Path) -> None:
    """Checked at launch, but a program can go (or not be one) by the time the guard execs it: one
    line in the worker's log and exit 127, as a shell says it."""
    script = tmp_path / "engine"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    log = tmp_path / "w.log"
    lines = LineLog()
    w = await WorkerProcess.launch([str(script)], env={}, lines=lines, log_file=log, header="h")
    assert await w.wait() == 127
    await w.drain_output(timeout=5.0)
    w.close()
    assert any(line.startswith(f"cannot start {script}:") for line in lines.tail(5)), lines.tail(5)


def test_a_missing_command_is_refused_at_launch_as_before() -> None:
    with pytest.raises(FileNotFoundError):
        resolve("no-such-engine-binary", {"PATH": "/usr/bin:/bin"})
    with pytest.raises(FileNotFoundError):
        guarded(["/no/such/engine"], {})
    with pytest.raises(PermissionError):  # a folder is no program
        guarded([os.path.dirname(sys.executable)], {})
    assert guarded(["python3", "-V"], {"PATH": os.path.dirname(sys.executable)})[-2:] == ["python3", "-V"]
