"""A worker's lease: the record that lets an engine outlive its proxy, and the watcher that ends it.

The proxy that owns a worker keeps a lease file beside the worker's log (``<log_dir>/<id>.lease``,
JSON, replaced atomically): owner, renewal and expiry, and the worker's identity (pid and its start
in clock ticks, port, engine, argv, args, pool, start time). :func:`wrapped` prefixes the engine's
command with this file, run as a script: it forks a watcher and then ``exec``\\ s the engine, so the
engine keeps the pid, the process group, the signals and the exit code the proxy was given, and its
output goes to the log file, not to a pipe that would break with the proxy. The watcher (a child of
the engine, in its group) stops the engine (SIGTERM to the group, SIGKILL after the grace) when its
lease is not renewed within the lease's ``ttl_s`` of its own monotonic clock, is gone, or names
another launch; it leaves when the engine is gone. A proxy started again reads the lease, checks
the worker is what it claims and takes the lease over (:mod:`proxy.workers.adopt`).

:data:`LEASE_TTL_S` is 60 s: a restarted proxy (a service manager's restart and its imports take
seconds) adopts its workers well within it, a stalled event loop misses a dozen renewals before it
counts, and an orphan holds its GPU at most a minute. ``PACER_WORKER_LEASE_S`` shortens it for
tests. Standard library only: the watcher runs before any of the proxy is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["LEASE_TTL_S", "lease_path", "lease_ttl_s", "owner", "proc_start", "read_lease", "wrapped", "write_lease"]

LEASE_TTL_S = 60.0
RENEWALS_PER_TTL = 12  # renewed every ttl / 12 (5 s): a missed renewal or two is no expiry
_TTL_ENV = "PACER_WORKER_LEASE_S"


def lease_ttl_s() -> float:
    """:data:`LEASE_TTL_S`, or ``PACER_WORKER_LEASE_S`` where it is set (tests)."""
    raw = os.environ.get(_TTL_ENV)
    return float(raw) if raw else LEASE_TTL_S


def lease_path(log_file: Path) -> Path:
    """Where the lease of the worker that logs to ``log_file`` lives."""
    return log_file.with_suffix(".lease")


def proc_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (a reused pid has another); None:
    no such process, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": pid, "pid_start": proc_start(pid)}


_owner_record: dict[str, Any] = {}


def owner() -> Mapping[str, Any]:
    """This proxy process, as its leases name it: an id of its own, its host, pid and start."""
    if not _owner_record:
        _owner_record.update(_owner())
    return _owner_record


def write_lease(path: Path, record: Mapping[str, Any]) -> None:
    """Write ``record`` to ``path`` at once (a reader sees the old lease or the new one, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the engine's arguments
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, default=str)
    os.replace(tmp, path)


def read_lease(path: Path) -> dict[str, Any] | None:
    """The lease at ``path``; None when there is none or it cannot be read."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def wrapped(argv: Sequence[str], env: Mapping[str, str], lease: Path, launch: str, grace_s: float) -> list[str]:
    """``argv`` run through this file: the same command, stopped when the lease at ``lease`` (whose
    ``launch`` field must be ``launch``) lapses; ``grace_s`` between SIGTERM and SIGKILL."""
    from proxy.workers.die_with_parent import resolve  # the proxy's side only: the watcher needs none of it

    executable = resolve(argv[0], env)
    return [sys.executable, "-I", os.path.abspath(__file__), str(lease), launch, repr(grace_s), executable, *argv]


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"pacer lease: {text}\n".encode())


def _lapsed(lease: Path, launch: str, state: dict[str, Any]) -> tuple[str | None, float]:
    """Why the lease no longer holds (None: it holds) and how long to wait before the next look."""
    record = read_lease(lease)
    if record is None:
        return "the lease is gone", 0.0
    if record.get("launch") != launch:
        return "the lease names another launch", 0.0
    ttl = float(record.get("ttl_s", LEASE_TTL_S))
    now = time.monotonic()
    if record.get("renewed") != state.get("renewed"):
        state["renewed"], state["seen"] = record.get("renewed"), now
    if now - state["seen"] > ttl:
        return f"the lease was not renewed for {ttl:g} s (its proxy is gone)", 0.0
    return None, min(5.0, max(0.05, ttl / RENEWALS_PER_TTL))


def _watch(engine: int, lease: Path, launch: str, grace_s: float) -> None:
    """The watcher's life: look at the lease until the engine is gone or the lease lapses."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the group's stop is the engine's, not ours
        signal.signal(sig, signal.SIG_IGN)
    os.close(0)
    state: dict[str, Any] = {"seen": time.monotonic()}
    while os.getppid() == engine:
        why, wait = _lapsed(lease, launch, state)
        if why is None:
            time.sleep(wait)
            continue
        _say(f"{why}: stopping the engine (pid {engine}; SIGTERM, SIGKILL after {grace_s:g} s)")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while os.getppid() == engine and time.monotonic() < deadline:
            time.sleep(0.05)
        break
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what is left of the worker (and us)
        os.killpg(engine, signal.SIGKILL)
    os._exit(0)


def _main(args: Sequence[str]) -> None:
    lease, launch, grace_s, executable, command = Path(args[0]), args[1], float(args[2]), args[3], list(args[4:])
    engine = os.getpid()
    if os.fork() == 0:
        try:
            _watch(engine, lease, launch, grace_s)
        finally:
            os._exit(0)
    # Python ignores these at its start and an ignored signal stays so across exec: the command gets
    # them as a process started directly does (what Popen's restore_signals gave it)
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execv(executable, command)
    except OSError as exc:  # checked before the launch, but it may have changed since, or not be a program
        print(f"cannot start {executable}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        sys.exit(127)


if __name__ == "__main__":
    _main(sys.argv[1:])
