"""Run a worker's command so that it dies with the process that started it.

A worker runs in a session of its own (so that stopping it reaches every process it forks), which
also means nothing ends it when the proxy (or a Ray actor) that owns it is killed outright: a
SIGKILL, an OOM kill, a crash. The engine would go on holding its GPU memory and its port, and the
proxy started again would launch a second one beside it. :func:`guarded` prefixes a command with
this file, run as a script by the same interpreter: on Linux it asks the kernel for SIGTERM when its
parent dies (``prctl(PR_SET_PDEATHSIG)``, which survives the ``exec``), gives up if the parent is
already gone, and then ``exec``\\ s the command itself, so the worker keeps the pid, the process group
and the output pipes it was given. SIGTERM and not SIGKILL: engines end their own children on it
(SGLang's scheduler processes also die with their parent; vLLM shuts its engine core down).
Elsewhere (no ``prctl``) the command is run as it is. Standard library only: it runs before any of
the proxy is imported.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence

__all__ = ["guarded", "resolve"]

_PR_SET_PDEATHSIG = 1


def resolve(command: str, env: Mapping[str, str]) -> str:
    """The executable ``command`` names, as ``exec`` would find it with ``env``'s ``PATH``; raises
    :class:`FileNotFoundError` (or :class:`PermissionError`) as starting it directly would, so a
    missing engine is still refused at launch rather than as an exit of the guard."""
    if os.sep in command:
        if not os.path.exists(command):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", command)
        if not os.path.isfile(command) or not os.access(command, os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied", command)
        return command
    found = shutil.which(command, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", command)
    return found


def guarded(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` run through this file: the same command, ended with SIGTERM if its parent dies."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), resolve(argv[0], env), *argv]


def _main(args: Sequence[str]) -> None:
    parent, executable, command = int(args[0]), args[1], list(args[2:])
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        sys.exit(128 + int(signal.SIGTERM))
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
