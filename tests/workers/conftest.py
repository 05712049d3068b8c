from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.policy import EngineSettings, parse_policy
from proxy.workers.lease import proc_start, read_lease
from proxy.workers.supervisor import Supervisor

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")


def engine_settings(tmp_path: Path, **engine: Any) -> EngineSettings:
    """An ``[engine]`` table that launches the fake worker, through the real policy parser."""
    table: dict[str, Any] = {
        "kind": "sim",
        "workers": 1,
        "command": [sys.executable, str(FAKE_WORKER)],
        "startup_timeout_s": 30.0,
        "stop_grace_s": 5.0,
        "log_dir": str(tmp_path / "logs"),
    }
    table.update(engine)
    return parse_policy({"engine": table}, "test").engine


@pytest.fixture
async def make_supervisor(tmp_path: Path) -> AsyncIterator[Callable[..., Supervisor]]:
    """Build supervisors for one test; every one is stopped at the end, whatever happened, and every
    worker a stop left running (``keep_on_exit``) ends."""
    made: list[Supervisor] = []

    def make(**engine: Any) -> Supervisor:
        sup = Supervisor(engine_settings(tmp_path, **engine), poll_interval_s=0.1)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        await sup.stop()
    for lease in (tmp_path / "logs").glob("*.lease"):
        record = read_lease(lease) or {}
        if isinstance(record.get("pid"), int) and proc_start(record["pid"]) == record.get("pid_start"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record["pid"], signal.SIGKILL)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
