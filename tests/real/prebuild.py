"""The session's build of the real-engine environments, in the background while the other tests run.

A fresh cache needs minutes of pip (envs.py), mostly download and unpack; run at the start of the
session, at the lowest CPU priority, it overlaps the rest of the suite, which orders the tests that
need an engine last (tests/conftest.py). Their fixtures wait for it, then take the environment as
usual: built, or built there when the background build failed, whose log then goes to the fixture's
output and to the session's summary, or raise the build's own error. The build runs in its own
process group, which ends when its standard input closes: when the session ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.wait import wait_until_blocking
from tests.real.envs import RECIPES, is_built, tiny_model_dir

# the fixtures (conftest.py) that need each environment
NEEDS = {"vllm_python": "vllm", "tiny_model": "vllm", "sglang_python": "sglang"}
ROOT = Path(__file__).parents[2]


def needs_engine(item: pytest.Item) -> bool:
    return any(name in NEEDS for name in getattr(item, "fixturenames", ()))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def built(name: str) -> bool:
    return is_built(RECIPES[name]) and (name != "vllm" or (tiny_model_dir() / ".complete").exists())


def missing(items: list[pytest.Item]) -> list[str]:
    """The environments the items need that are not built yet (the vLLM one with the tiny model), vLLM
    first: SGLang's links its torch."""
    wanted = {NEEDS[name] for item in items for name in getattr(item, "fixturenames", ()) if name in NEEDS}
    return [name for name in RECIPES if name in wanted and not built(name)]


@dataclass(frozen=True, slots=True)
class Build:
    """One background build: its process and its log."""

    proc: subprocess.Popen[bytes]
    log: Path
    names: tuple[str, ...]

    @classmethod
    def start(cls, names: list[str]) -> Build:
        with tempfile.NamedTemporaryFile(prefix="pacer-engine-envs-", suffix=".log", delete=False) as f:
            log = Path(f.name)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.real.envs", "--background", *names],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return cls(proc, log, tuple(names))

    def wait(self) -> str | None:
        """Once it ended: None if it built everything, else what to say of it. A build killed alone
        leaves its pip running in its process group: that ends too, before anyone builds there again."""
        rc = self.proc.wait()
        if rc == 0:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        wait_until_blocking(lambda: not _group_alive(self.proc.pid), "the build's processes gone", timeout=60)
        how = f"was killed (signal {-rc})" if rc < 0 else f"failed (exit {rc})"
        tail = self.log.read_text(errors="replace")[-3000:]
        return (
            f"the background build of the engine environments ({', '.join(self.names)}) {how}; log {self.log}:\n{tail}"
        )

    def finish(self) -> str | None:
        """At the session's end: stop it if it still runs (closing its standard input ends its process
        group); None if it built everything, else what to say of it."""
        running = self.proc.poll() is None
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if running:
            self.proc.wait()
            return (
                f"the background build of the engine environments ({', '.join(self.names)}) was stopped at the "
                f"session's end, unfinished: a later session builds what it lacks (log {self.log})"
            )
        failure = self.wait()
        if failure is None:
            self.log.unlink(missing_ok=True)
        return failure
