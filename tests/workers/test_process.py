"""A worker process's own waits give way to their caller's cancel: stopping the proxy during a
restart (the rollout cancelled while it stops or starts a worker) must not be held up by them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from proxy.workers.process import LineLog, WorkerProcess
from tests.harness.wait import wait_until

_SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"]


async def test_a_cancel_during_drain_output_reaches_the_caller(tmp_path: Path) -> None:
    """The worker is alive, its output open: drain_output waits; cancelling its caller cancels it."""
    lines = LineLog()
    process = await WorkerProcess.launch(_SLEEPER, env={}, lines=lines, log_file=tmp_path / "w.log", header="h")
    try:
        waiting = asyncio.create_task(process.drain_output(timeout=20.0))
        await wait_until(lambda: lines.tail(1) == ["up"], "the worker's first line")  # drain_output waits by now
        waiting.cancel()
        done, _ = await asyncio.wait({waiting}, timeout=5.0)
        assert waiting in done and waiting.cancelled(), "drain_output swallowed its caller's cancel"
    finally:
        await process.terminate(grace_s=5.0)
    assert process.returncode is not None


async def test_a_cancel_during_terminate_reaches_the_caller_and_the_process_still_goes(tmp_path: Path) -> None:
    """A worker that ignores SIGTERM: terminate waits out its grace; cancelled meanwhile, it stops
    waiting at once, and a later terminate (the pool's stop) still ends the process."""
    ignores_term = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(30)",
    ]
    lines = LineLog()
    process = await WorkerProcess.launch(ignores_term, env={}, lines=lines, log_file=tmp_path / "w.log", header="h")
    try:
        await wait_until(lambda: lines.tail(1) == ["up"], "the worker's first line")  # its handler is installed
        stopping = asyncio.create_task(process.terminate(grace_s=20.0))
        await asyncio.sleep(0)  # one turn: terminate sends SIGTERM, then waits out the grace
        stopping.cancel()
        done, _ = await asyncio.wait({stopping}, timeout=5.0)
        assert stopping in done and stopping.cancelled()
        assert process.returncode is None  # still there: its owner stops it
    finally:
        await process.terminate(grace_s=0.5)
    assert process.returncode is not None
