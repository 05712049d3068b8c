"""Shared helpers for the simulator tests: configs from SGLang argv, and a real server process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from proxy.sim.cli import build_parser, resolve_config
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine
from tests.harness.wait import wait_until_blocking

ROOT = Path(__file__).resolve().parents[2]


def config(*argv: str) -> SimConfig:
    return resolve_config(build_parser().parse_args(list(argv)))


def engine(*argv: str, logs: list[str] | None = None) -> Engine:
    sink = (lambda level, msg: logs.append(msg)) if logs is not None else None
    return Engine(config(*argv), log=sink)


def unique_prompt(n: int, salt: int) -> tuple[int, ...]:
    base = -(salt + 1) * 10_000_000
    return tuple(range(base, base + n))


def run_until(eng: Engine, predicate, t: float = 0.0, max_steps: int = 200_000) -> float:
    """Step the engine in virtual time until ``predicate()`` is true; returns the time."""
    for _ in range(max_steps):
        if predicate():
            return t
        step = eng.plan(t)
        if step is None:
            return t
        assert step.oom is None, f"unexpected {step.oom} OOM"
        t += step.duration
        eng.complete(step, t)
    raise AssertionError("predicate never held")


@dataclass
class SimProcess:
    proc: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread = field(default_factory=threading.Thread)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = 20.0) -> str:
        """The first line with ``needle``; fails at once when the process ended without one (all its
        output read: the reader thread is done)."""

        def found() -> str | None:
            exited = self.proc.poll() is not None and not self._reader.is_alive()
            line = next((x for x in list(self.lines) if needle in x), None)
            assert line is not None or not exited, f"process exited ({self.proc.returncode}) without {needle!r}"
            return line

        return wait_until_blocking(found, f"a line with {needle!r}", timeout=timeout, detail=self.log_text)

    def wait_ready(self, timeout: float = 20.0) -> None:
        self.wait_for_line("fired up and ready to roll", timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)  # a second when the machine is quiet; room for a starved CPU
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_sim(*argv: str, startup: float = 0.2, wait: bool = True) -> SimProcess:
    cmd = [sys.executable, "-m", "proxy", "sim", "--port", "0", "--sim-startup-seconds", str(startup), *argv]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    sim = SimProcess(proc=proc, port=0, lines=lines, _reader=reader)
    line = sim.wait_for_line("Uvicorn running on http://127.0.0.1:")
    m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
    assert m is not None, line
    sim.port = int(m.group(1))
    if wait:
        sim.wait_ready()
    return sim


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
