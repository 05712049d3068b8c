"""The supervisor: starts, watches, restarts and stops the engine workers of one policy.

Each managed worker is one process (:class:`~proxy.workers.process.WorkerProcess`) on its own
port, launched as ``command + build_argv(args, extra_args, host=..., port=...)``. A worker is
STARTING until ``GET /health`` answers 200, then READY. A process that exits on its own is DOWN,
with ``last_error`` saying how it ended and what its run printed last
(:func:`~proxy.workers.exit_text.describe_exit`); the controller, not the supervisor, decides to
restart it. ``restart`` starts a worker again on the same port with new args (the rollout sets it
DRAINING first). ``hold`` and ``report_unreachable`` take a worker out of READY at once.

One supervisor runs one pool (``Placement``: its name, model, each worker's GPUs and the flags
that placement sets); :class:`proxy.workers.fleet.Fleet` puts several pools behind one
:class:`WorkerPool`. External workers (``kind = "external"``) are only registered: a probe of
``/health`` moves them between READY and DOWN; they cannot be restarted.

A worker on this host runs on a lease the supervisor renews (:mod:`proxy.workers.lease`): it
outlives a proxy that dies by at most the lease, and ``start`` adopts the workers an earlier proxy
left (:mod:`proxy.workers.adopt`) instead of launching new ones. Listeners hear each state change
(sync ones inline, coroutine ones as tasks), line listeners each output line as it is read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import shlex
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from proxy.workers.adopt import AdoptedProcess, claim_problem, held_elsewhere, plain, served_problem
from proxy.workers.base import (
    LaunchPlanner,
    LineListener,
    StateListener,
    WorkerId,
    WorkerInfo,
    WorkerState,
    tell_listeners,
)
from proxy.workers.exit_text import describe_exit, what_it_said
from proxy.workers.launch_spec import configured_record, local_env, remote_env, worker_argv
from proxy.workers.lease import RENEWALS_PER_TTL, lease_path, lease_ttl_s, owner, proc_start, read_lease, write_lease
from proxy.workers.process import EXIT_UNKNOWN, Launcher, LeaseTerms, LineLog, LocalLauncher, WorkerHandle
from proxy.workers.slot import Placement, Slot

if TYPE_CHECKING:
    from proxy.policy import EngineSettings

_log = logging.getLogger(__name__)

_AFTER_READY_POLL_S = 0.05  # /health polls once the engine has logged that it is ready
_PORT_CLASH = ("address already in use", "errno 98", "eaddrinuse")
_PORT_RETRIES = 3
REFUSED = "connection refused"  # /health: nothing listening on the port (yet)


class WorkerError(RuntimeError):
    """An operation the supervisor cannot do for this worker (unknown id, external worker, ...)."""


def free_port(host: str, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A port nobody listens on right now (bind to 0, read it, release it)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
        if port not in taken:
            return port
    raise OSError("no free port found")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Supervisor:
    """Implements :class:`~proxy.workers.base.WorkerPool`, :class:`~proxy.workers.base.WorkerLogs` and
    :class:`~proxy.workers.base.PlannedLaunches` for one ``[engine]`` table."""

    def __init__(
        self,
        engine_settings: EngineSettings,
        *,
        placement: Placement | None = None,
        launcher: Launcher | None = None,
        poll_interval_s: float = 0.5,
        external_probe_interval_s: float = 5.0,
        ring_lines: int = 2000,
        lease_ttl: float | None = None,
        fence: Callable[[], int | None] | None = None,
    ) -> None:
        self._settings = engine_settings
        self._place = placement or Placement()
        self._launcher: Launcher = launcher or LocalLauncher()
        self._managed = engine_settings.managed
        self._engine = engine_settings.engine
        self._poll_s = poll_interval_s
        self._ready_marker = self._engine.ready_marker
        self._probe_s = external_probe_interval_s
        self._ring_lines = ring_lines
        self._slots: dict[WorkerId, Slot] = {}
        self._listeners: list[StateListener] = []
        self._untold: collections.deque[WorkerInfo] = collections.deque()  # changes not yet told (_tell)
        self._telling = False
        self._launch_planner: LaunchPlanner | None = None
        self._line_listeners: list[LineListener] = []
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._probe_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._lease_ttl = lease_ttl if lease_ttl is not None else lease_ttl_s()
        self._renewing: asyncio.Task[None] | None = None
        # replicas: the term this proxy leads in, None while it does not (it then writes no lease)
        self._fence = fence
        self._started = False
        self._stopping = False

    # ------------------------------------------------------------------ WorkerPool: reading

    def workers(self) -> list[WorkerInfo]:
        return [slot.info() for slot in self._slots.values()]

    def get(self, worker_id: WorkerId) -> WorkerInfo:
        return self._slot(worker_id).info()

    def add_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def add_line_listener(self, listener: LineListener) -> None:
        self._line_listeners.append(listener)

    def plan_launches(self, planner: LaunchPlanner) -> None:
        self._launch_planner = planner

    def tail(self, worker_id: WorkerId, n: int = 50) -> list[str]:
        return self._slot(worker_id).lines.run_tail(n)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Launch every managed worker (or register the external ones); returns when each is READY or DOWN."""
        if self._started:
            raise WorkerError("supervisor already started")
        self._started = True
        self._session = aiohttp.ClientSession()
        s = self._settings
        if not self._managed:
            for i, url in enumerate(s.urls):
                self._add_slot(
                    Slot(
                        id=self._place.worker_id(i),
                        port=0,
                        url=url,
                        managed=False,
                        state=WorkerState.STARTING,
                        pool=self._place.pool,
                        model=self._place.model,
                    )
                )
            await asyncio.gather(*(self._probe(slot) for slot in self._slots.values()))
            self._probe_task = asyncio.create_task(self._probe_loop(), name="external-worker-probe")
            return
        taken: set[int] = set()
        for i in range(s.workers):
            if s.base_port:
                port, fixed = s.base_port + i, True
            else:
                port, fixed = free_port(s.host, taken), False
            taken.add(port)
            args = {**s.args, **(s.worker_args[i] if i < len(s.worker_args) else {}), **self._place.args}
            self._add_slot(self._managed_slot(self._place.worker_id(i), port, fixed, args, self._place.gpus_of(i)))
        if self._launcher.local:
            self._renewing = asyncio.create_task(self._renew_leases(), name=f"leases-{self._place.pool}")
        found = await asyncio.gather(*(self._adopt(slot) for slot in self._slots.values()))
        fresh = [slot for slot, how in zip(self._slots.values(), found, strict=True) if how == "none"]
        for slot in fresh:
            await self._plan_launch(slot)
        changed = [slot for slot, how in zip(self._slots.values(), found, strict=True) if how == "changed"]
        await asyncio.gather(
            *(self._start_slot(slot, reason="start") for slot in fresh),
            *(self._restart_changed(slot) for slot in changed),
        )

    def _managed_slot(
        self, worker_id: WorkerId, port: int, fixed: bool, args: Mapping[str, object], gpus: tuple[int, ...]
    ) -> Slot:
        return Slot(
            id=worker_id,
            port=port,
            url=self._url(port),
            managed=True,
            args=dict(args),
            port_fixed=fixed,
            pool=self._place.pool,
            model=self._place.model,
            gpus=gpus,
            log_path=Path(self._settings.log_dir) / f"{worker_id}.log",
            lines=LineLog(self._ring_lines),
            configured=configured_record(self._settings, args, gpus, port if fixed else None),
        )

    async def replace_workers(
        self, old: Sequence[WorkerId], count: int, args: Mapping[str, object], reason: str
    ) -> list[WorkerInfo]:
        """A reshape's step: stop the ``old`` workers (drained by the caller) and start ``count`` workers
        with ``args`` on their GPUs, split evenly in order; the new take the lowest ids no other worker
        holds (an old one's id, its log and, where free, its port). Returns the new workers' infos once
        each is READY or DOWN; the old ones not reused are gone from the pool (told STOPPED first)."""
        slots = [self._slot(worker_id) for worker_id in old]
        if any(not slot.managed for slot in slots) or count < 1:
            raise WorkerError("a reshape replaces managed workers with at least one")
        if self._stopping:
            raise WorkerError("supervisor is stopped")
        worker_argv(self._settings, dict(args), 0)  # bad args fail here, before the old processes are stopped
        gpus = tuple(g for slot in slots for g in slot.gpus)
        if gpus and len(gpus) % count:
            raise WorkerError(f"{len(gpus)} GPUs do not split into {count} workers")
        for slot in slots:
            async with slot.lock:
                _log.info("stopping worker %s (%s)", slot.id, reason)
                await self._stop_slot(slot, locked=True)
        ports = {slot.id: slot.port for slot in slots}
        for slot in slots:
            del self._slots[slot.id]
            if slot.launch and slot.log_path is not None:
                with contextlib.suppress(OSError):
                    lease_path(slot.log_path).unlink(missing_ok=True)
        each = len(gpus) // count
        new: list[Slot] = []
        for j in range(count):
            worker_id = next(
                self._place.worker_id(i) for i in itertools.count() if self._place.worker_id(i) not in self._slots
            )
            port = ports.get(worker_id) or free_port(self._settings.host, {o.port for o in self._slots.values()})
            slot = self._managed_slot(worker_id, port, False, args, gpus[j * each : (j + 1) * each])
            self._add_slot(slot)
            new.append(slot)
        await asyncio.gather(*(self._start_slot(slot, reason=f"reshape: {reason}") for slot in new))
        return [slot.info() for slot in new]

    async def _plan_launch(self, slot: Slot) -> None:
        """The first launch's arguments, as the launch planner says (as configured when it fails)."""
        if self._launch_planner is None:
            return
        try:
            slot.args = dict(await self._launch_planner(slot.info()))
        except Exception:
            _log.exception("planning the first launch of %s failed: it starts as configured", slot.id)

    async def stop(self, *, leave: bool = False) -> None:
        """SIGTERM every managed worker, SIGKILL after ``stop_grace_s``, and end their leases; with
        ``keep_on_exit`` or ``leave`` (another replica leads them next), leave them running on their
        leases (for the next proxy to adopt); the supervisor is done after this."""
        self._stopping = True
        for task in (self._probe_task, self._renewing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._settings.keep_on_exit or leave:
            self._leave_running()
        await asyncio.gather(*(self._stop_slot(slot) for slot in self._slots.values()))
        for slot in self._slots.values():
            if slot.launch and slot.log_path is not None:
                with contextlib.suppress(OSError):
                    lease_path(slot.log_path).unlink(missing_ok=True)
        for slot in self._slots.values():
            if slot.state != WorkerState.STOPPED:
                self._set(slot, WorkerState.STOPPED)
        self._closed.set()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> WorkerInfo:
        """Stop ``worker_id`` and start it on the same port with ``args``; returns once READY or DOWN."""
        slot = self._slot(worker_id)
        if not slot.managed:
            raise WorkerError(f"worker {worker_id} is external ({slot.url}): the proxy cannot restart it")
        if self._stopping:
            raise WorkerError("supervisor is stopped")
        worker_argv(self._settings, dict(args), slot.port)  # bad args fail here, before the old process is stopped
        async with slot.lock:
            _log.info("restarting worker %s (%s)", worker_id, reason)
            await self._stop_slot(slot, locked=True)
            if dict(args) != slot.args:  # other arguments (a rule's, an operator's): no loop of these yet
                slot.crash_loop = False
            slot.args = dict(args)
            slot.restarts += 1
            await self._wait_port_free(slot.port)
            await self._start_slot(slot, reason=f"restart: {reason}", locked=True)
        return slot.info()

    def set_state(self, worker_id: WorkerId, state: WorkerState) -> WorkerInfo:
        """The drain hook: READY -> DRAINING before a restart, DRAINING -> READY to undo it."""
        slot = self._slot(worker_id)
        allowed = {
            (WorkerState.READY, WorkerState.DRAINING),
            (WorkerState.DRAINING, WorkerState.READY),
            (WorkerState.READY, WorkerState.READY),
            (WorkerState.DRAINING, WorkerState.DRAINING),
        }
        if (slot.state, state) not in allowed:
            raise WorkerError(f"worker {worker_id} is {slot.state}: cannot set it to {state}")
        if slot.state != state:
            self._set(slot, state)
        return slot.info()

    def hold(self, worker_id: WorkerId) -> WorkerInfo:
        """Nothing more is sent to the worker: READY -> DRAINING; a STARTING one comes up DRAINING
        when healthy (any other state takes no traffic anyway). Lifted by the worker's own next
        transitions: DOWN when it exits, its next start, READY."""
        slot = self._slot(worker_id)
        if slot.state is WorkerState.READY:
            self._set(slot, WorkerState.DRAINING)
        elif slot.state is WorkerState.STARTING:
            slot.held = True
        return slot.info()

    def report_unreachable(self, worker_id: WorkerId, error: str) -> None:
        """The request path could not connect. A managed worker is held (its process is dead or
        closing its port: its exit makes it DOWN); an external one is DOWN now, and the probe makes
        it READY again once its ``/health`` answers."""
        slot = self._slot(worker_id)
        if slot.managed:
            self.hold(worker_id)
        elif slot.state in (WorkerState.READY, WorkerState.DRAINING):
            self._set(slot, WorkerState.DOWN, error=f"unreachable: {error}")

    def declare_down(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> None:
        slot = self._slot(worker_id)
        if not slot.managed or slot.state is not WorkerState.DOWN or (slot.stays_down if for_good else slot.crash_loop):
            return
        if for_good:
            slot.stays_down = True
        elif slot.served:  # the run that died had served: deaths far apart, not a loop that dies as it starts
            return
        else:
            slot.crash_loop = True
        self._set(slot, WorkerState.DOWN, error=f"{slot.last_error or 'down'}; {why}")

    # ------------------------------------------------------------------ managed workers

    async def _start_slot(self, slot: Slot, *, reason: str, locked: bool = False) -> None:
        if not locked:
            async with slot.lock:
                return await self._start_slot(slot, reason=reason, locked=True)
        for attempt in range(_PORT_RETRIES + 1):
            if self._stopping:
                return
            local = self._launcher.local  # a remote node's ports are not ours to check
            if local and not slot.port_fixed and not port_is_free(self._settings.host, slot.port):
                self._move_port(slot)
            if local and slot.port_fixed and not port_is_free(self._settings.host, slot.port):
                slot.exit_code = None
                self._set(slot, WorkerState.DOWN, error=f"port {slot.port} on {self._settings.host} is already in use")
                return
            await self._launch(slot, worker_argv(self._settings, slot.args, slot.port), reason)
            clash = await self._wait_healthy(slot)
            if not clash or slot.port_fixed or attempt == _PORT_RETRIES:
                return
            _log.warning("worker %s: port %d was taken, trying another", slot.id, slot.port)
            self._move_port(slot)

    def _move_port(self, slot: Slot) -> None:
        taken = {other.port for other in self._slots.values()}
        slot.port = free_port(self._settings.host, taken)
        slot.url = self._url(slot.port)

    async def _launch(self, slot: Slot, argv: tuple[str, ...], reason: str) -> None:
        assert slot.log_path is not None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        shown = shlex.join(self._engine.masked_argv(argv))  # no API key in the log
        header = f"===== {stamp} pacer: {reason}: worker {slot.id} on port {slot.port}: {shown}"
        slot.argv = argv
        slot.stopping = False
        slot.exit_code = None
        slot.last_error = None
        slot.ready_seen.clear()
        slot.held = False
        slot.stays_down = slot.served = False
        slot.lines.begin_run()  # what this process says, apart from what an earlier run said
        lease = LeaseTerms("", self._settings.stop_grace_s)  # a cluster's worker keeps its own lease
        if self._launcher.local:  # a lease the worker's watcher follows: it outlives us by at most its ttl
            slot.launch, slot.launched, slot.process = uuid.uuid4().hex, time.time(), None
            self._write_lease(slot)
            lease = LeaseTerms(slot.launch, self._settings.stop_grace_s)
        try:
            process = await self._launcher.launch(
                argv,
                env=local_env(self._settings, slot.gpus) if self._launcher.local else remote_env(self._settings),
                lines=slot.lines,
                log_file=slot.log_path,
                header=header,
                worker_id=slot.id,
                num_gpus=self._place.num_gpus,
                lease=lease,
            )
        except OSError as e:
            slot.process = slot.watcher = None
            self._set(slot, WorkerState.DOWN, error=f"cannot start {argv[0]!r}: {e.strerror or e}")
            return
        if process.node is not None:  # placed by a cluster: where it runs and which GPUs it got there
            slot.node = process.node
            if process.address is not None and self._settings.host in ("0.0.0.0", "::"):
                slot.url = f"http://{process.address}:{slot.port}"
            slot.gpus = process.gpus or ()
        if self._stopping:  # stop() came while we were launching
            slot.stopping = True
            await process.terminate(self._settings.stop_grace_s)
            return
        slot.process = process
        self._write_lease(slot)
        self._set(slot, WorkerState.STARTING)
        slot.watcher = asyncio.create_task(self._watch(slot, process), name=f"watch-{slot.id}")

    def _on_line(self, worker_id: WorkerId, line: str) -> None:
        if self._ready_marker is not None and self._ready_marker in line:
            slot = self._slots.get(worker_id)
            if slot is not None:
                slot.ready_seen.set()  # probe /health now, not at the next poll
        for listener in list(self._line_listeners):
            try:
                listener(worker_id, line)
            except Exception:
                _log.exception("line listener failed")

    async def _watch(self, slot: Slot, process: WorkerHandle) -> None:
        """Wait for ``process`` to exit; unless we stopped it, the worker is DOWN."""
        code = await process.wait()
        process.kill_group()  # its children go with it (and close the output pipe they share)
        await process.drain_output(timeout=1.0)
        process.close()
        if slot.process is not process or slot.stopping:
            return
        slot.exit_code = None if code == EXIT_UNKNOWN else code
        self._set(slot, WorkerState.DOWN, error=describe_exit(code, slot.lines.run_tail(200)))

    async def _wait_healthy(self, slot: Slot) -> bool:
        """Poll /health until 200 (READY) or the process exits / time runs out (DOWN).

        Returns True when the process died of a port clash (the caller may retry on another port).
        """
        process = slot.process
        if process is None:
            return False
        watcher = slot.watcher
        assert watcher is not None
        deadline = time.monotonic() + self._settings.startup_timeout_s
        last_status = "no answer yet"
        while True:
            if watcher.done() or process.returncode is not None:
                await asyncio.shield(watcher)
                if slot.stopping or self._stopping:
                    return False
                text = " ".join(slot.lines.run_tail(30)).lower()
                return any(marker in text for marker in _PORT_CLASH)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            status = await self._health(slot.url, timeout=min(30.0, remaining))
            if status == 200 and process.returncode is None and slot.process is process:
                process.catch_up()  # what it said before it answered is heard first (a hold)
                self._set(slot, WorkerState.DRAINING if slot.held else WorkerState.READY)
                return False
            if isinstance(status, int):
                last_status = f"HTTP {status}"
            elif status == REFUSED or not last_status.startswith("HTTP"):
                last_status = status  # a poll that ran out of time does not hide what the worker last answered
            left = max(0.0, deadline - time.monotonic())
            if slot.ready_seen.is_set():  # the ready line came before /health said 200: it will soon
                await asyncio.wait({watcher}, timeout=min(self._poll_s, _AFTER_READY_POLL_S, left))
                continue
            hint = asyncio.ensure_future(slot.ready_seen.wait())
            try:  # the next poll, or the engine's ready line, whichever comes first
                await asyncio.wait(
                    {watcher, hint}, timeout=min(self._poll_s, left), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                hint.cancel()
        said = what_it_said(slot.lines.run_tail(200), 500)
        self._set(
            slot,
            WorkerState.DOWN,
            error=f"not healthy after {self._settings.startup_timeout_s:g} s (last /health: {last_status}); stopped"
            + (f"; it said last: {said}" if said else "; it printed nothing"),
        )
        slot.stopping = True
        await process.terminate(self._settings.stop_grace_s)
        return False

    async def _health(self, url: str, *, timeout: float) -> int | str:
        """The status of ``GET {url}/health``, or why nothing answered: :data:`REFUSED` (nothing
        listening), no answer within ``timeout``, or the connection's error."""
        assert self._session is not None
        try:
            async with self._session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status
        except TimeoutError:
            return f"no answer within {timeout:.2g} s"
        except aiohttp.ClientConnectorError:
            return REFUSED
        except (aiohttp.ClientError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def _stop_slot(self, slot: Slot, *, locked: bool = False) -> None:
        process = slot.process
        if process is None:
            return
        slot.stopping = True
        if process.returncode is None:
            code = await process.terminate(self._settings.stop_grace_s)
            slot.exit_code = None if code == EXIT_UNKNOWN else code
        else:
            process.kill_group()
            process.close()
        if slot.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await slot.watcher
        slot.process = None
        if slot.state != WorkerState.STOPPED:
            self._set(slot, WorkerState.STOPPED)

    async def _wait_port_free(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not port_is_free(self._settings.host, port) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ leases and adoption

    def _write_lease(self, slot: Slot) -> None:
        """Write (or renew) the lease of ``slot``'s current launch, ours for the next ttl."""
        if not slot.launch or slot.log_path is None:
            return
        term = None if self._fence is None else self._fence()
        if self._fence is not None and (term is None or self._later_term(slot.log_path, term)):
            return  # no longer the replicas' leader: the worker is another's to renew
        now, pid = time.time(), slot.process.pid if slot.process is not None else None
        record = {
            "worker": slot.id,
            "pool": slot.pool,
            "engine": self._engine.name,
            "owner": owner(),
            "launch": slot.launch,
            "ttl_s": self._lease_ttl,
            "renewed": now,
            "expires": now + self._lease_ttl,
            "pid": pid,
            "pid_start": proc_start(pid) if pid is not None else None,
            "port": slot.port,
            "url": slot.url,
            "argv": list(slot.argv),
            "args": plain(slot.args),
            "configured": slot.configured,
            "started": slot.launched,
            "restarts": slot.restarts,
            "term": term,
        }
        try:
            write_lease(lease_path(slot.log_path), record)
        except OSError as exc:
            _log.warning("worker %s: cannot write its lease: %s", slot.id, exc)

    @staticmethod
    def _later_term(log_path: Path, term: int) -> bool:
        """Whether the worker's lease was written by the leader of a later term than ``term``."""
        held = (read_lease(lease_path(log_path)) or {}).get("term")
        return isinstance(held, int) and held > term

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl / RENEWALS_PER_TTL)
            for slot in self._slots.values():
                if slot.process is not None and slot.process.returncode is None:
                    self._write_lease(slot)

    def _leave_running(self) -> None:
        """Let go of every live worker (``keep_on_exit``): its lease, renewed one last time, gives the
        next proxy its ttl to adopt it; no proxy by then, and its watcher stops it."""
        for slot in self._slots.values():
            process = slot.process
            if process is not None and process.returncode is None and (slot.launch or not self._launcher.local):
                self._write_lease(slot)
                slot.launch, slot.stopping, slot.process = "", True, None
                if slot.watcher is not None:
                    slot.watcher.cancel()
                process.close()
                _log.info("worker %s (pid %d) left running for the next proxy", slot.id, process.pid)

    async def _adopt(self, slot: Slot) -> str:
        """Take over the worker an earlier proxy left on ``slot`` when its lease says there is one and
        it is what the lease claims: "adopted", "changed" (adopted, but the policy changed since:
        restart it), "refused" (another live proxy owns it) or "none" (start one: a worker that
        claimed the slot but is not what it claims is stopped first)."""
        if not self._launcher.local or slot.log_path is None:
            return "none"
        lease = read_lease(lease_path(slot.log_path))
        if lease is None:
            return "none"
        if held := held_elsewhere(
            lease, term=None if self._fence is None else self._fence()
        ):  # two proxies in one folder: the second starts nothing
            slot.stays_down = True  # a launch here would end the other proxy's worker (its lease)
            self._set(slot, WorkerState.DOWN, error=f"not adopted: {held}")
            return "refused"
        pid, port = lease.get("pid"), lease.get("port")
        if problem := claim_problem(lease, worker_id=slot.id, pool=slot.pool, engine=self._engine.name):
            _log.warning("worker %s: the worker its lease names is not adopted: %s", slot.id, problem)
            return "none"  # not that worker's process (any more): not ours to signal
        assert self._session is not None and isinstance(pid, int)
        problem = "its lease names no port"
        if isinstance(port, int):
            problem = await served_problem(self._session, self._engine, lease, self._near_host(), port)
        if problem is not None:  # the worker's own process, but not serving as it should: stopped
            _log.warning("worker %s: pid %d is not adopted (stopped): %s", slot.id, pid, problem)
            await self._stop_claimed(slot, pid)
            return "none"
        assert isinstance(pid, int) and isinstance(port, int)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        header = f"===== {stamp} pacer: adopted: worker {slot.id} (pid {pid}) on port {port}"
        slot.port, slot.url = port, self._url(port)
        slot.argv = tuple(str(a) for a in lease.get("argv") or ())
        slot.args = dict(lease.get("args") or {})
        slot.restarts = int(lease.get("restarts") or 0)
        slot.launch, slot.launched = str(lease["launch"]), float(lease.get("started") or time.time())
        slot.lines.begin_run()
        slot.process = AdoptedProcess(pid, slot.lines, slot.log_path, header)
        self._write_lease(slot)  # ours now: its watcher sees the renewal
        _log.info("worker %s: adopted pid %d on port %d from an earlier proxy", slot.id, pid, port)
        self._set(slot, WorkerState.STARTING)
        slot.watcher = asyncio.create_task(self._watch(slot, slot.process), name=f"watch-{slot.id}")
        await self._wait_healthy(slot)
        return "adopted" if lease.get("configured") == slot.configured else "changed"

    async def _stop_claimed(self, slot: Slot, pid: int) -> None:
        """Stop a worker of ours that cannot be adopted (it holds a port, maybe a GPU)."""
        assert slot.log_path is not None
        process = AdoptedProcess(pid, LineLog(8), slot.log_path, f"===== pacer: stopping pid {pid}: not adopted")
        await process.terminate(self._settings.stop_grace_s)

    async def _restart_changed(self, slot: Slot) -> None:
        """An adopted worker whose policy changed while no proxy ran: restarted with what the policy
        says now, by the normal path (the same port unless the policy fixes another)."""
        if slot.state is not WorkerState.READY:
            return  # not healthy: DOWN already, the controller revives it with the policy's arguments
        configured = dict(slot.configured.get("args") or {})  # type: ignore[call-overload]
        fixed = slot.configured.get("port")
        if isinstance(fixed, int) and fixed != slot.port:
            slot.port, slot.url, slot.port_fixed = fixed, self._url(fixed), True
        planned = dict(configured)
        if self._launch_planner is not None:
            with contextlib.suppress(Exception):
                planned = dict(await self._launch_planner(dataclasses.replace(slot.info(), args=configured)))
        self._set(slot, WorkerState.DRAINING)  # what it runs ends; nothing new is sent to it
        await self.restart(slot.id, planned, "its policy changed while no proxy ran")

    # ------------------------------------------------------------------ external workers

    async def _probe(self, slot: Slot) -> None:
        status = await self._health(slot.url, timeout=5.0)
        if status == 200:
            if slot.state in (WorkerState.STARTING, WorkerState.DOWN):
                self._set(slot, WorkerState.READY)
        elif isinstance(status, str):
            if slot.state != WorkerState.DOWN:
                self._set(slot, WorkerState.DOWN, error=f"unreachable: no answer from {slot.url}/health ({status})")
        elif slot.state == WorkerState.DOWN and status == 503:
            self._set(slot, WorkerState.STARTING)  # answering again, not ready yet

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._probe_s)
            await asyncio.gather(*(self._probe(slot) for slot in self._slots.values()))

    # ------------------------------------------------------------------ helpers

    def _near_host(self) -> str:
        """The host the workers are reached on from here."""
        host = self._settings.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)

    def _url(self, port: int) -> str:
        host = self._near_host()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _add_slot(self, slot: Slot) -> None:
        self._slots[slot.id] = slot
        slot.lines.add_sink(functools.partial(self._on_line, slot.id))

    def worker_ids(self) -> tuple[WorkerId, ...]:
        """The ids of this pool's workers, known before they start."""
        s = self._settings
        return tuple(self._place.worker_id(i) for i in range(s.workers if self._managed else len(s.urls)))

    def _slot(self, worker_id: WorkerId) -> Slot:
        try:
            return self._slots[worker_id]
        except KeyError:
            raise WorkerError(f"no worker {worker_id!r}; known: {', '.join(self._slots) or 'none'}") from None

    def _set(self, slot: Slot, state: WorkerState, *, error: str | None = None) -> None:
        slot.state = state
        if state is WorkerState.READY:
            slot.crash_loop, slot.served = False, True  # it started: the loop is over
        if error is not None:
            slot.last_error = error
        if state == WorkerState.DOWN:
            _log.warning("worker %s is down: %s", slot.id, slot.last_error)
        else:
            _log.info("worker %s is %s (%s)", slot.id, state, slot.url)
        self._tell(slot.info())

    def _tell(self, info: WorkerInfo) -> None:
        """Every listener hears of ``info``, in order of the changes: a change a listener makes while
        it is told (the controller's declare_down) is told after the one it heard."""
        self._untold.append(info)
        if self._telling:
            return
        self._telling = True
        try:
            while self._untold:
                tell_listeners(self._listeners, self._untold.popleft(), self._tasks)
        finally:
            self._telling = False


__all__ = ["Supervisor", "WorkerError", "free_port", "port_is_free"]
