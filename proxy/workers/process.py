"""One worker process: launch, follow its output line by line, stop it with its whole process group.

:class:`WorkerProcess` runs one command in its own session (so its process group holds every child
it forks), merges stdout and stderr into one pipe and reads that pipe with asyncio. Each complete
line is appended to the worker's log file, to a bounded ring (:class:`LineLog`) and handed to the
line sinks as soon as it is read. Nothing here knows about health, states or engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from proxy.workers.die_with_parent import guarded

LineSink = Callable[[str], None]
_log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_MAX_LINE = 64 * 1024  # a longer "line" is cut and passed on in pieces


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
    def kill_group(self) -> None: ...
    def close(self) -> None: ...


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
    ) -> WorkerHandle:
        return await WorkerProcess.launch(argv, env=env, lines=lines, log_file=log_file, header=header)

    async def close(self) -> None:
        return None


class WorkerProcess:
    """A launched command; ``await WorkerProcess.launch(...)`` returns once the process exists."""

    node: str | None = None
    address: str | None = None
    gpus: tuple[int, ...] | None = None

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        output: asyncio.StreamReader,
        pipe: asyncio.BaseTransport,
        argv: Sequence[str],
        lines: LineLog,
        log_file: Path,
    ) -> None:
        self._proc = proc
        self._pipe = pipe
        self.argv = tuple(argv)
        self.started_at = time.monotonic()
        self._lines = lines
        self._log = log_file.open("ab")
        self._reader = asyncio.create_task(self._read(output), name=f"worker-output-{proc.pid}")

    @classmethod
    async def launch(
        cls, argv: Sequence[str], *, env: Mapping[str, str], lines: LineLog, log_file: Path, header: str
    ) -> WorkerProcess:
        """Start ``argv`` in a new session, ended with SIGTERM if the proxy dies (:mod:`.die_with_parent`);
        ``header`` is written to the log file first."""
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("ab") as f:
            f.write(header.rstrip("\n").encode() + b"\n")
        # Our own pipe rather than asyncio's: asyncio's Process.wait() also waits for its pipes to
        # close, and a child of the worker that inherited them would hide the worker's death.
        read_fd, write_fd = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *guarded(argv, env),  # ended with the proxy, should the proxy be killed outright
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_fd,
                stderr=write_fd,
                env=dict(env),
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        output = asyncio.StreamReader(limit=_CHUNK, loop=loop)
        try:
            pipe, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(output, loop=loop), os.fdopen(read_fd, "rb", 0)
            )
        except BaseException:  # cancelled (the proxy is stopping): nobody would own the process
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        return cls(proc, output, pipe, argv, lines, log_file)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        """Wait for the process (the group leader) to exit; its output may still be in flight."""
        return await self._proc.wait()

    async def drain_output(self, timeout: float) -> None:
        """Let the reader reach EOF; a child that keeps the pipe open must not hold us up for long."""
        # asyncio.wait neither cancels the reader nor raises its end; a cancel of the caller goes through
        await asyncio.wait({self._reader}, timeout=timeout)

    async def terminate(self, grace_s: float) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):  # not 3.11's wait_for, which may swallow the caller's cancel
                code = await self._proc.wait()
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            code = await self._proc.wait()
        # Children that ignored SIGTERM (or outlived the leader) go too.
        self._signal_group(signal.SIGKILL)
        await self.drain_output(timeout=1.0)
        self.close()
        return code

    def kill_group(self) -> None:
        """SIGKILL the whole group now (used after the leader died on its own)."""
        self._signal_group(signal.SIGKILL)

    def close(self) -> None:
        if not self._reader.done():
            self._reader.cancel()
        self._pipe.close()
        if not self._log.closed:
            self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def _read(self, stream: asyncio.StreamReader) -> None:
        pending = b""
        try:
            while True:
                chunk = await stream.read(_CHUNK)
                if not chunk:
                    break
                self._log.write(chunk)
                self._log.flush()
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    self._emit(raw)
                while len(pending) > _MAX_LINE:
                    self._emit(pending[:_MAX_LINE])
                    pending = pending[_MAX_LINE:]
            if pending:
                self._emit(pending)
        finally:
            if not self._log.closed:
                self._log.flush()

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        # a progress bar rewrites its line with \r: keep only what a terminal would show last
        if "\r" in line:
            line = line.rsplit("\r", 1)[-1]
        self._lines.push(line)
