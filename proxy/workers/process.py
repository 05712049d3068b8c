"""One worker process: launch, follow its output line by line, stop it with its whole process group.

:class:`WorkerProcess` runs one command in its own session (so its process group holds every child
it forks), its stdout and stderr appended to the worker's log file, which :class:`LogFollower`
reads as it grows: each complete line goes to a bounded ring (:class:`LineLog`) and to the line
sinks. The engine writes to the file, not to a pipe of the proxy's, so it outlives the proxy
(:mod:`proxy.workers.lease` decides for how long) and a proxy started again follows the same file.
Nothing here knows about health, states or engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from proxy.workers.lease import lease_path, wrapped

LineSink = Callable[[str], None]
_log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_MAX_LINE = 64 * 1024  # a longer "line" is cut and passed on in pieces
_FOLLOW_POLL_S = 0.05  # how soon a line the worker wrote reaches the proxy


class LineLog:
    """The last ``maxlen`` lines of one worker (across restarts) and the live sinks that want each new one.

    :meth:`begin_run` marks where a launch's output begins: :meth:`run_tail` is that run's alone (a
    death is explained by what the process that died said, not by an earlier run's last words)."""

    def __init__(self, maxlen: int = 2000) -> None:
        self._ring: deque[str] = deque(maxlen=maxlen)
        self._sinks: list[LineSink] = []
        self._pushed = 0  # lines pushed since this log was made
        self._run_began = 0  # ... when the current run began

    def add_sink(self, sink: LineSink) -> Callable[[], None]:
        """Register ``sink``; returns a function that removes it."""
        self._sinks.append(sink)
        return lambda: self._sinks.remove(sink) if sink in self._sinks else None

    def begin_run(self) -> None:
        """The lines pushed from now on are a new run's (called before each launch)."""
        self._run_began = self._pushed

    def push(self, line: str) -> None:
        self._ring.append(line)
        self._pushed += 1
        for sink in list(self._sinks):
            try:
                sink(line)
            except Exception:  # a broken consumer must not stop the log
                _log.exception("line sink failed")

    def tail(self, n: int) -> list[str]:
        """The last ``n`` lines, whichever runs they came from."""
        if n <= 0:
            return []
        return list(self._ring)[-n:]

    def run_tail(self, n: int) -> list[str]:
        """The last ``n`` lines of the current run (the last one, once it ended)."""
        return self.tail(min(n, self._pushed - self._run_began))


EXIT_UNKNOWN = -(1 << 16)  # an adopted worker's end: not our child, so its exit code is not ours to read


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class WorkerHandle(Protocol):
    """A launched worker as the supervisor drives it: :class:`WorkerProcess` on this host, or a
    remote one (:mod:`proxy.workers.ray_backend`) that says where it runs and which GPUs it got."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def node(self) -> str | None: ...  # None: this host
    @property
    def address(self) -> str | None: ...  # the host its server answers on (None: the policy's host)
    @property
    def gpus(self) -> tuple[int, ...] | None: ...  # the GPUs it was given there (None: as placed here)

    async def wait(self) -> int: ...
    async def drain_output(self, timeout: float) -> None: ...
    async def terminate(self, grace_s: float) -> int: ...
    def catch_up(self) -> None: ...  # what it wrote so far reaches the line log now
    def kill_group(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """What a launch on this host needs for its lease (:mod:`proxy.workers.lease`): the launch's own
    token (the lease must name it), the grace between SIGTERM and SIGKILL when it lapses."""

    launch: str
    grace_s: float


class Launcher(Protocol):
    """Starts worker processes: :class:`LocalLauncher` here, or on a cluster."""

    @property
    def local(self) -> bool: ...  # ports and CUDA_VISIBLE_DEVICES are this host's

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
        lease: LeaseTerms | None = None,
    ) -> WorkerHandle: ...

    async def close(self) -> None: ...


class LocalLauncher:
    """Worker processes on this host (the default backend)."""

    local = True

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
        lease: LeaseTerms | None = None,
    ) -> WorkerHandle:
        return await WorkerProcess.launch(argv, env=env, lines=lines, log_file=log_file, header=header, lease=lease)

    async def close(self) -> None:
        return None


class LogFollower:
    """Reads a worker's log file from ``offset`` as the worker appends to it, line by line into
    ``lines``: the engine writes its output to the file itself, so a proxy that dies breaks no pipe
    of the engine's, and the next one follows the same file."""

    def __init__(self, log_file: Path, offset: int, lines: LineLog, poll_s: float = _FOLLOW_POLL_S) -> None:
        self._file = log_file.open("rb")
        self._file.seek(offset)
        self._lines = lines
        self._poll_s = poll_s
        self._ended = asyncio.Event()
        self._pending = b""
        self.task = asyncio.create_task(self._follow(), name=f"follow-{log_file.name}")
        self.task.add_done_callback(lambda _: self._file.close())  # also when cancelled before it ran

    def ended(self) -> None:
        """The process is gone: read what is left and stop."""
        self._ended.set()

    def catch_up(self) -> bool:
        """Read every line written so far (what a worker said before it answered comes before its
        READY); returns whether there was anything to read."""
        read = False
        while not self._file.closed and (chunk := self._file.read(_CHUNK)):
            read = True
            self._pending += chunk
            *complete, self._pending = self._pending.split(b"\n")
            for raw in complete:
                self._emit(raw)
            while len(self._pending) > _MAX_LINE:
                self._emit(self._pending[:_MAX_LINE])
                self._pending = self._pending[_MAX_LINE:]
        return read

    async def _follow(self) -> None:
        while True:
            ended = self._ended.is_set()  # before the read: what it wrote before it ended is read
            if self.catch_up() or not ended:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await self._ended.wait()
                continue
            break
        if self._pending:
            self._emit(self._pending)

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        # a progress bar rewrites its line with \r: keep only what a terminal would show last
        if "\r" in line:
            line = line.rsplit("\r", 1)[-1]
        self._lines.push(line)

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the follower to read the file to its end, once
        :meth:`ended` was called."""
        # asyncio.wait neither cancels the reader nor raises its end; a cancel of the caller goes through
        await asyncio.wait({self.task}, timeout=timeout)

    def close(self) -> None:
        if not self.task.done():
            self.task.cancel()


def append_header(log_file: Path, header: str) -> int:
    """Write ``header`` as one line at the end of ``log_file``; returns the offset after it."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as f:
        f.write(header.rstrip("\n").encode() + b"\n")
        return f.tell()


async def wait_gone(pid: int, alive: Callable[[], bool], poll_s: float = 0.2) -> None:
    """Return once ``alive()`` is False: woken by a pidfd on ``pid`` (Linux), looked at every
    ``poll_s`` where there is none, and every few seconds anyway."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = -1
    try:
        if fd >= 0:
            ended: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, lambda: None if ended.done() else ended.set_result(None))
            try:
                while alive() and not ended.done():
                    await asyncio.wait({ended}, timeout=5.0)
            finally:
                loop.remove_reader(fd)
        while alive():
            await asyncio.sleep(poll_s)
    finally:
        if fd >= 0:
            os.close(fd)


class WorkerProcess:
    """A launched command; ``await WorkerProcess.launch(...)`` returns once the process exists.

    Started with :class:`subprocess.Popen`, not asyncio's subprocess: asyncio kills a child still
    running when its transport closes, and a worker left running (``keep_on_exit``) must not be."""

    node: str | None = None
    address: str | None = None
    gpus: tuple[int, ...] | None = None

    def __init__(self, proc: subprocess.Popen[bytes], follower: LogFollower, argv: Sequence[str]) -> None:
        self._proc = proc
        self._follower = follower
        self.argv = tuple(argv)
        self.started_at = time.monotonic()
        self._exit = asyncio.create_task(self._wait_exit(), name=f"worker-exit-{proc.pid}")

    @classmethod
    async def launch(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        lines: LineLog,
        log_file: Path,
        header: str,
        lease: LeaseTerms | None = None,
    ) -> WorkerProcess:
        """Start ``argv`` in a new session, its stdout and stderr appended to ``log_file`` after
        ``header``; with ``lease``, watched by its lease (:mod:`.lease`), else run as it is."""
        offset = append_header(log_file, header)
        command = list(argv)
        if lease is not None:
            command = wrapped(argv, env, lease_path(log_file), lease.launch, lease.grace_s)
        out = os.open(log_file, os.O_WRONLY | os.O_APPEND)
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=dict(env), start_new_session=True
            )
        finally:
            os.close(out)
        return cls(proc, LogFollower(log_file, offset, lines), argv)

    async def _wait_exit(self) -> int:
        await wait_gone(self._proc.pid, lambda: self._proc.poll() is None)
        self._follower.ended()
        return self._proc.returncode

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        """Wait for the process (the group leader) to exit; its last output may still be unread."""
        return await asyncio.shield(self._exit)

    async def drain_output(self, timeout: float) -> None:
        """Read what the process wrote before it ended (at most ``timeout`` seconds)."""
        await self._follower.drain(timeout)

    async def terminate(self, grace_s: float) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):  # not 3.11's wait_for, which may swallow the caller's cancel
                code = await self.wait()
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            code = await self.wait()
        # Children that ignored SIGTERM (or outlived the leader) go too.
        self._signal_group(signal.SIGKILL)
        await self.drain_output(timeout=1.0)
        self.close()
        return code

    def kill_group(self) -> None:
        """SIGKILL the whole group now (used after the leader died on its own)."""
        self._signal_group(signal.SIGKILL)

    def catch_up(self) -> None:
        self._follower.catch_up()

    def close(self) -> None:
        """Stop following its output (and its end: a process still running is left to its lease)."""
        self._follower.close()
        if not self._exit.done():
            self._exit.cancel()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
