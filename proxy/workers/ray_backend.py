"""The Ray worker backend: each managed worker is a Ray actor that owns its engine process on a
node with the GPUs the worker needs.

    async with RayLauncher(address="auto", namespace="pacer") as launcher:
        pool = Supervisor(engine_settings, placement=..., launcher=launcher)

The supervisor drives a Ray worker as a local one. ``launch`` creates an :class:`EngineActor`
reserving ``num_gpus`` GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``); the actor runs the engine command
and keeps its output lines. :class:`RayWorker`, the proxy's handle, pulls those lines into the
worker's log (the controller reads them as a local worker's) and waits for the engine's exit. A
lost actor is the worker's death (exit -9): the supervisor marks it DOWN and revives it wherever
Ray finds the GPUs. A restart with new arguments is a stop and a new actor.

Actors outlive the proxy, as local workers do (:mod:`proxy.workers.lease`): each is detached and
named ``worker:<worker id>`` in the launcher's namespace (one deployment, one namespace). The
holding proxy renews the actor's lease every ``ttl / 12``; a thread in the actor stops the engine
and ends the actor once no renewal came for the ttl. A launch first looks the name up: an actor
whose holder is gone and whose engine runs this very command is re-attached, untouched; one that
runs another command is replaced; one a live proxy holds is not taken (the launch fails).

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

from proxy.workers.adopt import held_elsewhere
from proxy.workers.die_with_parent import guarded
from proxy.workers.lease import RENEWALS_PER_TTL, lease_ttl_s, owner
from proxy.workers.process import LeaseTerms, LineLog, WorkerHandle

__all__ = ["EngineActor", "RayLauncher", "RayWorker", "actor_name"]

_log = logging.getLogger(__name__)
_LOST = -int(signal.SIGKILL)  # a lost actor reads as a worker killed by SIGKILL
_KEEP_LINES = 20000  # lines an actor keeps for the proxy to pull
_GRACE_S = 10.0  # SIGTERM to SIGKILL when the launch names no grace (engine.stop_grace_s's default)
_NAME_FREE_S = 30.0  # how long a killed actor's name may take to be free again


def actor_name(worker_id: str) -> str:
    """The name of ``worker_id``'s actor in its deployment's namespace."""
    return f"worker:{worker_id}"


def _renew_every(ttl_s: float) -> float:
    return min(5.0, max(0.05, ttl_s / RENEWALS_PER_TTL))


class EngineActor:
    """Runs inside a Ray actor: owns one engine process and its output (plain class; see :func:`_actor_class`)."""

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], spec: Mapping[str, Any], lease: Mapping[str, Any]
    ) -> None:
        import ray

        self._lines: deque[tuple[int, str]] = deque(maxlen=_KEEP_LINES)
        self._next = self._pulled = 0
        self._lock = threading.Lock()
        self._spec, self._holder = dict(spec), dict(lease["holder"])
        self._ttl, self._grace = float(lease["ttl_s"]), float(lease["grace_s"])
        self._renewed = time.monotonic()
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
        threading.Thread(target=self._keep_lease, daemon=True).start()

    def _keep_lease(self) -> None:
        """End the engine and this actor once the lease went ``ttl`` without a renewal (the proxy is gone)."""
        while True:
            time.sleep(_renew_every(self._ttl))
            with self._lock:
                idle = time.monotonic() - self._renewed
            if idle > self._ttl:
                break
        text = f"the lease was not renewed for {self._ttl:g} s (its proxy is gone): stopping the engine"
        with contextlib.suppress(OSError):
            os.write(2, f"pacer lease: {text} (pid {self._proc.pid})\n".encode())
        self.stop(self._grace)
        os._exit(0)  # the actor ends (max_restarts=0): Ray frees its GPUs and its name

    def claim(self) -> dict[str, Any]:
        """What a proxy looking for this worker needs to know: the command, its holder, the engine."""
        with self._lock:
            idle = time.monotonic() - self._renewed
            return {"spec": self._spec, "holder": self._holder, "idle_s": idle, "where": self._where}

    def attach(self, holder: Mapping[str, Any]) -> tuple[int | None, int]:
        """Held by ``holder`` from now on: the engine's exit code (None: it runs) and the first line no
        proxy has pulled yet."""
        with self._lock:
            self._holder, self._renewed = dict(holder), time.monotonic()
            return self._proc.poll(), self._pulled

    def renew(self, holder_id: str) -> bool:
        """Renew the lease; False: another proxy holds it now."""
        with self._lock:
            if self._holder.get("id") != holder_id:
                return False
            self._renewed = time.monotonic()
            return True

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
            self._pulled = max(self._pulled, since)  # the caller has every line before ``since``
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
        self,
        actor: Any,
        where: Mapping[str, Any],
        lines: LineLog,
        log_file: Path,
        poll_s: float,
        worker_id: str,
        *,
        renew_s: float,
        cursor: int = 0,
    ) -> None:
        self._actor = actor
        self._where = where
        self._lines = lines
        self._log = log_file.open("a", encoding="utf-8")
        self._poll_s = poll_s
        self._cursor = cursor
        self._code: int | None = None
        self._pulling = asyncio.create_task(self._pull(), name=f"ray-lines-{worker_id}")
        self._renewing = asyncio.create_task(self._renew(renew_s, worker_id), name=f"ray-lease-{worker_id}")

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

    async def _renew(self, every_s: float, worker_id: str) -> None:
        """Renew the actor's lease while this proxy holds it (ended by :meth:`close`)."""
        import ray

        holder = str(owner()["id"])
        while True:
            await asyncio.sleep(every_s)
            try:
                held = await self._actor.renew.remote(holder)
            except ray.exceptions.RayError:
                return  # the actor is gone: wait() says so
            if not held:
                _log.warning("worker %s: another proxy holds its Ray actor now: no longer renewed", worker_id)
                return

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
        """Stop following the actor (and renewing its lease: with no other proxy, it ends within it)."""
        self._pulling.cancel()
        self._renewing.cancel()
        if not self._log.closed:
            self._log.close()


class RayLauncher:
    """Starts workers as detached, named Ray actors on the cluster at ``address`` (``"local"``: a new
    one-node cluster) in ``namespace``, or re-attaches the ones an earlier proxy left there;
    ``lease_s``: the actors' lease (:func:`~proxy.workers.lease.lease_ttl_s` when None)."""

    local = False

    def __init__(
        self, address: str = "auto", namespace: str = "pacer", poll_s: float = 1.0, lease_s: float | None = None
    ) -> None:
        self.address = address
        self.namespace = namespace
        self.poll_s = poll_s
        self.lease_s = lease_s if lease_s is not None else lease_ttl_s()
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
            await asyncio.to_thread(ray.shutdown)  # detached actors stay: each lives on its lease
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
        lease: LeaseTerms | None = None,  # its grace only: the actor keeps the lease itself
    ) -> WorkerHandle:
        """The actor of ``worker_id`` an earlier proxy left running ``argv``, re-attached; else a new
        one reserving ``num_gpus`` GPUs (and no CPU slot: the engine is the work), running ``argv``."""
        import ray

        log_file.parent.mkdir(parents=True, exist_ok=True)
        spec = {"argv": list(argv), "env": dict(env), "num_gpus": num_gpus}
        grace_s = lease.grace_s if lease is not None else _GRACE_S
        found = await self._reattach(worker_id, spec, log_file, grace_s)
        if found is not None:
            actor, where, cursor = found
            return RayWorker(
                actor, where, lines, log_file, self.poll_s, worker_id, renew_s=self._renew_s, cursor=cursor
            )
        _append(log_file, header)
        terms = {"holder": dict(owner()), "ttl_s": self.lease_s, "grace_s": grace_s}
        started = time.monotonic()
        actor = await self._create(worker_id, argv, env, spec, terms)
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
        return RayWorker(actor, where, lines, log_file, self.poll_s, worker_id, renew_s=self._renew_s)

    @property
    def _renew_s(self) -> float:
        return _renew_every(self.lease_s)

    async def _create(
        self,
        worker_id: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        spec: Mapping[str, Any],
        terms: Mapping[str, Any],
    ) -> Any:
        """A new detached actor named for ``worker_id`` (waiting for a killed one's name to be free)."""
        name = actor_name(worker_id)
        options = _actor_class().options(
            name=name,
            namespace=self.namespace,
            lifetime="detached",  # not the driver's: it outlives this proxy, on its lease
            num_gpus=spec["num_gpus"],
            num_cpus=0,
            max_restarts=0,
        )
        for attempt in range(2):
            try:
                return options.remote(list(argv), dict(env), dict(spec), dict(terms))
            except ValueError as exc:  # the name is still taken: an actor killed a moment ago
                if attempt:
                    raise OSError(f"Ray actor {name!r}: {exc}") from exc
                await self._gone(name)
        raise AssertionError("unreachable")

    async def _named(self, name: str) -> Any:
        """The live actor called ``name`` in our namespace; None: there is none."""
        import ray

        try:
            return await asyncio.to_thread(ray.get_actor, name, self.namespace)
        except ValueError:
            return None

    async def _gone(self, name: str) -> None:
        """Kill the actor called ``name`` (if any) and wait until its name is free."""
        import ray

        deadline = time.monotonic() + _NAME_FREE_S
        while (actor := await self._named(name)) is not None and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            await asyncio.sleep(0.05)

    async def _reattach(
        self, worker_id: str, spec: Mapping[str, Any], log_file: Path, grace_s: float
    ) -> tuple[Any, Mapping[str, Any], int] | None:
        """The actor an earlier proxy left for ``worker_id``, now ours, with where it runs and the first
        line to pull; None: there is none (one running another command, or whose engine ended, was
        stopped). Raises :class:`OSError` when another live proxy holds it."""
        import ray

        name = actor_name(worker_id)
        actor = await self._named(name)
        if actor is None:
            return None
        try:
            record = await self._claimable(actor)
        except ray.exceptions.RayError:
            record = None  # ending (killed a moment ago): its name is free soon
        if record is None or record["holder"].get("id") == owner()["id"]:
            await self._gone(name)  # ours (a restart or a revival asks for a new one), or ending
            return None
        problem = _reattach_problem(record, spec)
        try:
            if problem is None:
                code, cursor = await actor.attach.remote(dict(owner()))
                problem = None if code is None else f"its engine exited (code {code})"
        except ray.exceptions.RayError as exc:
            problem = f"its actor is gone ({type(exc).__name__})"
        if problem is None:
            where = record["where"]
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            _append(log_file, f"===== {stamp} pacer: re-attached: worker {worker_id} (pid {where['pid']}, Ray actor)")
            _log.info("worker %s: re-attached its Ray actor (pid %s on %s)", worker_id, where["pid"], where["address"])
            return actor, where, cursor
        _log.warning("worker %s: its Ray actor is not re-attached (stopped): %s", worker_id, problem)
        _append(log_file, f"pacer: the worker's Ray actor is not re-attached (stopped): {problem}")
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(actor.stop.remote(grace_s), grace_s + 10.0)
        await self._gone(name)
        return None

    async def _claimable(self, actor: Any) -> dict[str, Any]:
        """``actor``'s claim record once no live proxy holds it; raises :class:`OSError` while one does.
        A holder on another host is gone once it missed three renewals (its pid is not ours to see)."""
        stale_s = 3 * self._renew_s
        for attempt in range(2):
            record: dict[str, Any] = await actor.claim.remote()
            holder = record["holder"]
            if holder.get("host") == owner()["host"]:
                if held := held_elsewhere({"owner": holder}):
                    raise OSError(f"its Ray actor is held: {held}")
                return record
            if record["idle_s"] > stale_s:
                return record
            if not attempt:
                await asyncio.sleep(stale_s - record["idle_s"] + self._renew_s)
        raise OSError(f"its Ray actor is held by a live proxy on {holder.get('host')} (it renews its lease)")


def _reattach_problem(record: Mapping[str, Any], spec: Mapping[str, Any]) -> str | None:
    """What keeps an actor (its claim record) from being re-attached for ``spec``, in words."""
    was = record["spec"]  # the lease's holder is gone (:meth:`RayLauncher._claimable`), not ours
    for key, what in (("argv", "command"), ("env", "environment"), ("num_gpus", "GPU count")):
        if was.get(key) != spec[key]:
            return f"its {what} changed"
    return None


def _append(log_file: Path, line: str) -> None:
    with log_file.open("a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
