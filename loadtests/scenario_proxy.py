"""The proxy a scenario's arm runs: its policy and its process.

Every arm runs the shipped ``[control]`` (``policies/default.toml``) as written, in the arm's mode
and its own directory (:func:`policy_toml`); the report says what the adaptive arm ran
(:func:`control_hash`, :func:`shipped_control`). :class:`ProxyProcess` is ``pacer serve`` as a child
process of this checkout, with its peak resident memory and its planner's process's read from ``/proc``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from loadtests.scenario_defs import Scenario

__all__ = [
    "PACING",
    "SHIPPED_POLICY",
    "ProxyProcess",
    "arm_control",
    "control_hash",
    "policy_toml",
    "shipped_control",
    "shipped_pacing",
]

# a batch deployment's band: the queue is held near 100 + headroom; without a fresh sample the proxy
# sends at most running + 400 (not 2000 at once, which buries the worker before its first scrape)
PACING: dict[str, Any] = {"queue_band": [100, 400], "scrape_interval_s": 0.5, "stale_after_s": 3.0}
_LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")
_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_POLICY = _ROOT / "policies" / "default.toml"  # what `make run` serves: its [control] is the product


def shipped_control() -> dict[str, Any]:
    """The shipped policy's ``[control]`` table, as written there."""
    return _shipped_table("control")


def shipped_pacing() -> dict[str, Any]:
    """The shipped policy's ``[pacing]`` table, as written there (what ``make run`` paces with)."""
    return _shipped_table("pacing")


def _shipped_table(name: str) -> dict[str, Any]:
    with SHIPPED_POLICY.open("rb") as f:
        return dict(tomllib.load(f).get(name, {}))


def control_hash(table: Mapping[str, Any]) -> str:
    """A short hash of a ``[control]`` table: its keys and values, in key order."""
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def arm_control(mode: str, control: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``[control]`` an arm runs: ``control`` (None: the shipped table) with the arm's mode. Its
    relative ``journal_path`` lands in the arm's own directory (the proxy runs there)."""
    return {**(shipped_control() if control is None else control), "mode": mode}


# -- the policy -------------------------------------------------------------------------------------


def policy_toml(
    sc: Scenario,
    args: Mapping[str, Any],
    mode: str,
    workdir: Path,
    worker_args: Sequence[Mapping[str, Any]] = (),
    control: Mapping[str, Any] | None = None,
    pacing: Mapping[str, Any] | None = None,
) -> str:
    """The policy of one arm: ``sc.workers`` simulated workers with ``args`` (and each its own
    ``worker_args`` over them), control ``mode``; its other ``[control]`` keys are ``control``'s
    (None: the shipped policy's, unchanged); its ``[pacing]`` is ``pacing`` (None: :data:`PACING`)."""
    engine_extra: dict[str, Any] = {"worker_args": [dict(a) for a in worker_args]} if worker_args else {}
    tables: dict[str, dict[str, Any]] = {
        "proxy": {"host": "127.0.0.1", "port": 0, "request_timeout_s": 3600.0, "status_log_interval_s": 5.0},
        "queue": {"capacity": 100000, "timeout_s": sc.queue_timeout_s},
        "engine": {"kind": "sim", "workers": sc.workers, **engine_extra,
                   "args": {k: v for k, v in args.items() if v is not None},
                   "extra_args": sc.extra_args(), "log_dir": str(workdir / "logs"), "startup_timeout_s": 600.0,
                   # fixed on the wall clock, not scaled: the simulator's exit at SIGTERM (its server's
                   # cleanup) takes wall time whatever its modelled clock; 5 s bounds it below the default
                   "stop_grace_s": 5.0},
        "pacing": dict(PACING if pacing is None else pacing),
        "control": arm_control(mode, control),
    }  # fmt: skip
    return tomli_w.dumps(tables)


# -- the proxy process ------------------------------------------------------------------------------


class ProxyProcess:
    """``pacer serve`` as a child process, run in ``cwd`` (the policy's relative paths land there: the
    journal, the batch store); its log goes to ``log_path``."""

    def __init__(self, policy_path: Path, log_path: Path, cwd: Path | None = None) -> None:
        self.policy_path = policy_path
        self.log_path = log_path
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self._pump: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 120.0) -> str:
        # the proxy of this checkout, wherever it runs
        path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--policy", str(self.policy_path), "--port", "0",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
            cwd=self.cwd,
        )  # fmt: skip
        found: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pump = asyncio.create_task(self._read_log(found))
        try:
            self.url = await asyncio.wait_for(asyncio.shield(found), timeout_s)
        except (TimeoutError, RuntimeError):
            await self.stop()
            raise RuntimeError(f"pacer serve did not start; see {self.log_path}") from None
        return self.url

    async def _read_log(self, found: asyncio.Future[str]) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with self.log_path.open("ab") as log:
            async for line in self.proc.stderr:
                log.write(line)
                if not found.done():
                    m = _LISTENING.search(line.decode(errors="replace"))
                    if m:
                        found.set_result(m.group(1))
        if not found.done():
            found.set_exception(RuntimeError("pacer serve exited"))

    def peak_rss_mb(self) -> float | None:
        """The process's peak resident memory so far, from ``/proc`` (None where there is none)."""
        return None if self.proc is None else _peak_rss_mb(self.proc.pid)

    def planner_peak_rss_mb(self) -> float | None:
        """The peak resident memory of the planner's process (the proxy's child spawned by
        ``multiprocessing``; its workers are children too), from ``/proc``; None: none started."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        peaks = []
        for child in children:
            try:
                spawned = b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if spawned and (peak := _peak_rss_mb(int(child))) is not None:
                peaks.append(peak)
        return sum(peaks) if peaks else None

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)


def _peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (Linux: ``VmHWM`` in ``/proc``; None where there is none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(m.group(1)) / 1024 if m else None
