"""What a managed worker is launched with: its command line, its environment, and the record of
what the policy configured for it.

These follow from the ``[engine]`` table alone, so they live apart from the supervisor, which
decides when to launch; the adopted-worker check compares the configured record with a lease's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from proxy.workers.adopt import plain

if TYPE_CHECKING:
    from proxy.policy import EngineSettings


def command(settings: EngineSettings) -> list[str]:
    """The launcher the worker's flags follow: the policy's ``command``, else the engine's default."""
    return list(settings.command) if settings.command else settings.engine.default_command()


def worker_argv(settings: EngineSettings, args: Mapping[str, object], port: int) -> tuple[str, ...]:
    """The full command line of one worker on ``port``."""
    flags = settings.engine.build_argv(args, settings.extra_args, host=settings.host, port=port)
    return (*command(settings), *flags)


def local_env(settings: EngineSettings, gpus: tuple[int, ...] = ()) -> dict[str, str]:
    """The environment of a worker on this host: ours, the policy's variables, and its GPUs."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines must arrive as they are written
    env.update(settings.env)
    if gpus:  # its own GPUs, numbered from 0 inside the worker
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


def remote_env(settings: EngineSettings) -> dict[str, str]:
    """What a worker on another node gets from us: the policy's variables only (its GPUs are set there)."""
    return {"PYTHONUNBUFFERED": "1", **settings.env}


def configured_record(
    settings: EngineSettings, args: Mapping[str, object], gpus: tuple[int, ...], port: int | None
) -> dict[str, object]:
    """What the policy says of one worker (its lease keeps it: a change restarts an adopted worker)."""
    return plain(
        {
            "args": args,
            "env": settings.env,
            "gpus": gpus,
            "port": port,
            "command": command(settings),
            "extra": settings.extra_args,
        }
    )
