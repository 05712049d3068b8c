"""A worker left running by a proxy that is gone, taken over by the next one.

:func:`held_elsewhere` says whether another live proxy on this host still owns a lease;
:func:`claim_problem` whether the process it names is still that worker (alive, the same start in
clock ticks), :func:`served_problem` whether its port answers and its own
server info agrees. :class:`AdoptedProcess` is the :class:`~proxy.workers.process.WorkerHandle` of such a worker:
not our child, so its end is seen through a pidfd (polled where there is none) and its exit code
is not known (:data:`EXIT_UNKNOWN`); its output is followed in its log file from the adoption on.
The supervisor renews the lease from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from proxy.workers.lease import owner, proc_start
from proxy.workers.process import EXIT_UNKNOWN, LineLog, LogFollower, append_header, wait_gone

if TYPE_CHECKING:
    from proxy.engines.contract import Engine

__all__ = ["AdoptedProcess", "claim_problem", "held_elsewhere", "plain", "served_problem"]

_POLL_S = 0.2  # how often a worker's end is looked for where there is no pidfd


def plain(value: Mapping[str, object]) -> dict[str, object]:
    """``value`` as JSON gives it back (tuples as lists): what a lease holds compares equal to it."""
    out: dict[str, object] = json.loads(json.dumps(value, default=str))
    return out


def _owner_alive(record: Mapping[str, Any]) -> bool:
    """Whether the proxy that ``record`` (a lease's owner) names still runs (on this host; another
    host's is not ours to see: its lease's expiry says)."""
    me = owner()
    if record.get("id") == me["id"]:
        return False  # ours: a lease this process wrote
    if record.get("host") != me["host"]:
        return True
    pid = record.get("pid")
    return isinstance(pid, int) and proc_start(pid) == record.get("pid_start")


def held_elsewhere(lease: Mapping[str, Any], *, term: int | None = None) -> str | None:
    """Which live proxy other than this one owns ``lease``, in words; None: none does. ``term``: this
    proxy leads the replicas in that term (:mod:`proxy.workers.replicas`): a lease written in an
    earlier term is a deposed leader's, whether or not that proxy still runs."""
    held_term = lease.get("term")
    if term is not None and isinstance(held_term, int) and held_term < term:
        return None
    holder = lease.get("owner")
    if isinstance(holder, Mapping) and _owner_alive(holder):
        return f"another proxy owns it (pid {holder.get('pid')} on {holder.get('host')})"
    return None


def claim_problem(lease: Mapping[str, Any], *, worker_id: str, pool: str, engine: str) -> str | None:
    """What keeps the worker ``lease`` names from being adopted as ``worker_id`` of ``pool`` running
    ``engine``, in words; None: it is that worker and its process is alive."""
    if (lease.get("worker"), lease.get("pool"), lease.get("engine")) != (worker_id, pool, engine):
        return f"the lease is of {lease.get('engine')} worker {lease.get('worker')} of pool {lease.get('pool')}"
    pid = lease.get("pid")
    if not isinstance(pid, int) or proc_start(pid) is None:
        return "its process is gone"
    # the pid and when it started say which process it is (a reused pid started later); not its
    # command line, which an engine may rewrite (a process title)
    if proc_start(pid) != lease.get("pid_start"):
        return f"pid {pid} is another process now"
    return None


def answers(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


async def served_problem(
    session: aiohttp.ClientSession, engine: Engine, lease: Mapping[str, Any], host: str, port: int
) -> str | None:
    """What the server on ``host:port`` says against ``lease``, in words (None: it is that worker):
    nothing answers, or its own server info (where ``engine`` has one) disagrees."""
    if not await asyncio.to_thread(answers, host, port):
        return f"nothing answers on port {port}"
    path = engine.server_info_path
    if path is None:
        return None
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
            info = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"its {path} did not answer ({type(exc).__name__})"
    if not isinstance(info, Mapping):
        return f"its {path} is no JSON object"
    args, started = lease.get("args"), lease.get("started")
    return engine.server_info_disagrees(
        info,
        args=args if isinstance(args, Mapping) else {},
        port=port,
        launched=float(started) if isinstance(started, (int, float)) else 0.0,
    )


class AdoptedProcess:
    """A worker process another proxy launched, driven as one this proxy launched."""

    node: str | None = None
    address: str | None = None
    gpus: tuple[int, ...] | None = None

    def __init__(self, pid: int, lines: LineLog, log_file: Path, header: str) -> None:
        self._pid = pid
        self._start = proc_start(pid)
        self.returncode: int | None = None if self._start is not None else EXIT_UNKNOWN
        self._follower = LogFollower(log_file, append_header(log_file, header), lines)
        self._gone = asyncio.get_running_loop().create_future()
        self._watch = asyncio.create_task(self._wait_gone(), name=f"adopted-{pid}")

    @property
    def pid(self) -> int:
        return self._pid

    def _alive(self) -> bool:
        return self._start is not None and proc_start(self._pid) == self._start

    async def _wait_gone(self) -> None:
        await wait_gone(self._pid, self._alive)
        self.returncode = EXIT_UNKNOWN
        self._follower.ended()

    async def wait(self) -> int:
        await asyncio.shield(self._watch)
        return EXIT_UNKNOWN

    async def drain_output(self, timeout: float) -> None:
        await self._follower.drain(timeout)

    async def terminate(self, grace_s: float) -> int:
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await self.wait()
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            await self.wait()
        self._signal_group(signal.SIGKILL)
        await self.drain_output(timeout=1.0)
        self.close()
        return EXIT_UNKNOWN

    def catch_up(self) -> None:
        self._follower.catch_up()

    def kill_group(self) -> None:
        self._signal_group(signal.SIGKILL)

    def close(self) -> None:
        self._follower.close()
        if not self._watch.done():
            self._watch.cancel()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._alive() or sig is signal.SIGKILL:  # a reused pid's group is not ours: its leader's start says
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pid, sig)
