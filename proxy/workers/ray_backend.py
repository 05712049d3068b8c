"""The Ray worker backend: each managed worker is a Ray actor that owns its engine process on a
node with the GPUs the worker needs.

    async with RayLauncher(address="auto", namespace="pacer") as launcher:
        pool = Supervisor(engine_settings, placement=..., launcher=launcher)

The supervisor drives a Ray worker exactly as a local one (:class:`~proxy.workers.process.WorkerHandle`):
``launch`` creates an :class:`EngineActor` reserving ``num_gpus`` GPUs (Ray's GPU accounting
chooses which and sets ``CUDA_VISIBLE_DEVICES`` in the actor, which the engine process inherits);
the actor starts the engine command and keeps its output lines. :class:`RayWorker` (the handle on
the proxy's side) reports the actor's node and address and the GPU ids Ray gave it, pulls the
output lines into the worker's log file and ring (so the proxy's log followers, the controller
included, read them as they read a local worker's), and waits for the engine's exit. A lost actor
(its node died, or it was killed) is the worker's death, with exit code -9 and a log line saying
so: the supervisor marks it DOWN and the controller's revive and crash-loop logic apply unchanged;
the revived worker is a new actor, placed wherever Ray finds the GPUs. A restart with new
arguments is a stop (the actor ends its engine, then is killed) and a new actor.

Ray is an optional dependency (the ``fleet`` extra); this module imports it when a launcher opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from proxy.workers.die_with_parent import guarded
from proxy.workers.process import LeaseTerms, LineLog, WorkerHandle

__all__ = ["EngineActor", "RayLauncher", "RayWorker"]

_log = logging.getLogger(__name__)
_LOST = -int(signal.SIGKILL)  # a lost actor reads as a worker killed by SIGKILL
_KEEP_LINES = 20000  # lines an actor keeps for the proxy to pull


class EngineActor:
    """Runs inside a Ray actor: owns one engine process and its output (plain class; see :func:`_actor_class`)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        import ray

        self._lines: deque[tuple[int, str]] = deque(maxlen=_KEEP_LINES)
        self._next = 0
        self._lock = threading.Lock()
        merged = {**os.environ, **env}  # the actor's environment carries Ray's CUDA_VISIBLE_DEVICES
        self._proc = subprocess.Popen(
            guarded(argv, merged),  # ended with the actor, should Ray kill it
            env=merged,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        context = ray.get_runtime_context()
        self._where = {
            "node_id": context.get_node_id(),
            "address": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "gpus": [int(g) for g in ray.get_gpu_ids()],
            "visible": merged.get("CUDA_VISIBLE_DEVICES", ""),
            "pid": self._proc.pid,
        }

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._lines.append((self._next, line))
                self._next += 1

    def where(self) -> dict[str, Any]:
        return self._where

    def lines(self, since: int) -> tuple[int, list[str]]:
        """Lines numbered ``since`` and later, and the next number to ask for."""
        with self._lock:
            return self._next, [line for n, line in self._lines if n >= since]

    def poll(self) -> int | None:
        return self._proc.poll()

    def stop(self, grace_s: float) -> int:
        """SIGTERM the engine's process group, SIGKILL it after ``grace_s``; its exit code."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            code = self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            code = self._proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._reader.join(timeout=1.0)
        return code


_ACTOR: Any = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(EngineActor)
    return _ACTOR


class RayWorker:
    """The proxy's handle of one worker's actor (:class:`~proxy.workers.process.WorkerHandle`)."""

    def __init__(
        self, actor: Any, where: Mapping[str, Any], lines: LineLog, log_file: Path, poll_s: float, worker_id: str
    ) -> None:
        self._actor = actor
        self._where = where
        self._lines = lines
        self._log = log_file.open("a", encoding="utf-8")
        self._poll_s = poll_s
        self._cursor = 0
        self._code: int | None = None
        self._pulling = asyncio.create_task(self._pull(), name=f"ray-lines-{worker_id}")

    @property
    def pid(self) -> int:
        return int(self._where["pid"])

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def node(self) -> str:
        return f"{self._where['address']} ({str(self._where['node_id'])[:12]})"

    @property
    def address(self) -> str:
        return str(self._where["address"])

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(int(g) for g in self._where["gpus"])

    async def _pull_once(self) -> None:
        self._cursor, new = await self._actor.lines.remote(self._cursor)
        for line in new:
            self._emit(line)

    def _emit(self, line: str) -> None:
        if not self._log.closed:
            self._log.write(line + "\n")
            self._log.flush()
        self._lines.push(line)

    async def _pull(self) -> None:
        import ray

        while True:
            try:
                await self._pull_once()
            except ray.exceptions.RayError:
                return  # the actor is gone: wait() says so
            await asyncio.sleep(min(self._poll_s, 0.2))

    async def wait(self) -> int:
        """The engine's exit code, or -9 when the actor (or its node) is lost."""
        import ray

        while self._code is None:
            try:
                code = await self._actor.poll.remote()
            except ray.exceptions.RayError as exc:
                self._emit(f"pacer: the worker's Ray actor is lost (node down or actor killed): {type(exc).__name__}")
                self._code = _LOST
                break
            if code is not None:
                with contextlib.suppress(ray.exceptions.RayError):
                    await self._pull_once()
                self._code = int(code)
                break
            await asyncio.sleep(self._poll_s)
        return self._code

    async def drain_output(self, timeout: float) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(self._pull_once(), timeout)

    async def terminate(self, grace_s: float) -> int:
        import ray

        try:
            code = await asyncio.wait_for(self._actor.stop.remote(grace_s), grace_s + 10.0)
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                await asyncio.wait_for(self._pull_once(), 2.0)
            self._code = int(code)
        except (ray.exceptions.RayError, TimeoutError):
            self._code = _LOST
        self.kill_group()
        self.close()
        return self._code

    def catch_up(self) -> None:
        return None  # its lines come as the actor's output is polled

    def kill_group(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)

    def close(self) -> None:
        self._pulling.cancel()
        if not self._log.closed:
            self._log.close()


class RayLauncher:
    """Starts workers as Ray actors on the cluster at ``address`` (``"local"``: a new one-node cluster)."""

    local = False

    def __init__(self, address: str = "auto", namespace: str = "pacer", poll_s: float = 1.0) -> None:
        self.address = address
        self.namespace = namespace
        self.poll_s = poll_s
        self._owns = False

    async def __aenter__(self) -> RayLauncher:
        import ray

        if not ray.is_initialized():
            kw: dict[str, Any] = {"namespace": self.namespace, "log_to_driver": False}
            if self.address != "local":
                kw["address"] = self.address
            await asyncio.to_thread(ray.init, **kw)
            self._owns = True
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        import ray

        if self._owns and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
        self._owns = False

    async def launch(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        lines: LineLog,
        log_file: Path,
        header: str,
        worker_id: str,
        num_gpus: int,
        lease: LeaseTerms | None = None,  # none here: the actor is the engine's parent (die_with_parent)
    ) -> WorkerHandle:
        """A new actor reserving ``num_gpus`` GPUs (and no CPU slot: the engine is the work), running ``argv``."""
        import ray

        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a", encoding="utf-8") as f:
            f.write(header.rstrip("\n") + "\n")
        actor = _actor_class().options(num_gpus=num_gpus, num_cpus=0, max_restarts=0).remote(list(argv), dict(env))
        started = time.monotonic()
        try:
            where = await actor.where.remote()
        except ray.exceptions.RayError as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise OSError(f"Ray could not start the worker's actor: {exc}") from exc
        _log.info(
            "worker %s: Ray actor on %s, GPUs %s (CUDA_VISIBLE_DEVICES=%s), placed in %.1f s",
            worker_id,
            where["address"],
            where["gpus"],
            where["visible"],
            time.monotonic() - started,
        )
        return RayWorker(actor, where, lines, log_file, self.poll_s, worker_id)
