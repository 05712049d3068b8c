"""A Ray actor's worker dies with the actor that launched it, even when the actor is killed outright
(a SIGKILL leaves it no chance to stop its worker): an engine left running would hold its GPU memory
and its port. (Workers on the proxy's own host outlive it on a lease instead: test_lease.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.workers.die_with_parent import guarded, resolve
from tests.harness.wait import wait_until_blocking

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# A parent that launches a sleeping worker the way a Ray actor does, says its pid, and waits to be killed.
_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from proxy.workers.die_with_parent import guarded

    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    w = subprocess.Popen(guarded(sleeper, {}), start_new_session=True, stdout=subprocess.DEVNULL)
    print(w.pid, flush=True)
    time.sleep(60)
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
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[:-1]
    except (ProcessLookupError, FileNotFoundError):
        return []


def test_a_worker_ends_when_its_launcher_is_killed_outright(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tmp_path / "w.log")], stdout=subprocess.PIPE, text=True
    )
    worker = 0
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        # the guard has asked for its signal and exec'd the command: the worker runs as the engine would
        wait_until_blocking(
            lambda: _alive(worker) and _cmdline(worker)[1:2] == [b"-c"], "the worker running its command"
        )
        parent.kill()
        parent.wait()
        wait_until_blocking(lambda: not _alive(worker), "the worker gone with the process that launched it")
    finally:
        parent.kill()
        parent.wait()
        if worker and _alive(worker):
            os.killpg(worker, 9)


def test_a_missing_command_is_refused_at_launch_as_before() -> None:
    with pytest.raises(FileNotFoundError):
        resolve("no-such-engine-binary", {"PATH": "/usr/bin:/bin"})
    with pytest.raises(FileNotFoundError):
        guarded(["/no/such/engine"], {})
    with pytest.raises(PermissionError):  # a folder is no program
        guarded([os.path.dirname(sys.executable)], {})
    assert guarded(["python3", "-V"], {"PATH": os.path.dirname(sys.executable)})[-2:] == ["python3", "-V"]
