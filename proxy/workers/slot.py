"""One pool's placement and the supervisor's record of each worker it runs.

:class:`Placement` says where a pool's workers run and what that adds to their arguments;
:class:`Slot` is everything the supervisor knows about one worker (its process, state, lines,
lease). They live apart from the supervisor so that its module holds only the lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proxy.workers.base import WorkerId, WorkerInfo, WorkerState
from proxy.workers.process import LineLog, WorkerHandle


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where one pool's workers run and what that adds to their arguments."""

    pool: str = "default"
    model: str | None = None
    gpus: tuple[tuple[int, ...], ...] = ()  # per worker ((): no placement, CUDA_VISIBLE_DEVICES left as it is)
    args: Mapping[str, object] = field(default_factory=dict)  # the engine's placement flags (tp, served name)
    worker_ids: tuple[str, ...] = ()  # () : w0, w1, ...
    num_gpus: int = 0  # GPUs a cluster launcher reserves per worker (its own accounting picks which)
    id_prefix: str = "w"  # a worker past ``worker_ids`` (a reshape's) is this and its index

    def worker_id(self, index: int) -> str:
        return self.worker_ids[index] if index < len(self.worker_ids) else f"{self.id_prefix}{index}"

    def gpus_of(self, index: int) -> tuple[int, ...]:
        return self.gpus[index] if index < len(self.gpus) else ()


@dataclass(slots=True)
class Slot:
    """Everything the supervisor knows about one worker; ``info()`` is its public snapshot."""

    id: WorkerId
    port: int
    url: str
    managed: bool
    args: dict[str, object] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    state: WorkerState = WorkerState.STOPPED
    restarts: int = 0
    last_error: str | None = None
    exit_code: int | None = None
    log_path: Path | None = None
    port_fixed: bool = True  # False: chosen by us, may be changed on a clash at first start
    process: WorkerHandle | None = None
    node: str | None = None  # where it runs, when not on this host
    watcher: asyncio.Task[None] | None = None
    lines: LineLog = field(default_factory=LineLog)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stopping: bool = False  # set while we stop the process on purpose
    ready_seen: asyncio.Event = field(default_factory=asyncio.Event)  # the engine logged its ready line
    held: bool = False  # held while starting: it comes up DRAINING, not READY (lifted by its next start)
    stays_down: bool = False  # given up on: nothing will start it again (lifted by its next launch)
    crash_loop: bool = False  # dies as it starts, revived after each death (lifted once it is READY)
    served: bool = False  # its current (or last) run was READY at some point
    pool: str = "default"
    model: str | None = None
    gpus: tuple[int, ...] = ()
    launch: str = ""  # this launch's token, which its lease names ("": no lease)
    launched: float = 0.0  # wall time of the launch
    configured: dict[str, object] = field(default_factory=dict)  # what the policy said of it (its lease keeps it)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            id=self.id,
            url=self.url,
            state=self.state,
            managed=self.managed,
            args=dict(self.args),
            argv=self.argv,
            pid=self.process.pid if self.process is not None and self.process.returncode is None else None,
            restarts=self.restarts,
            last_error=self.last_error,
            exit_code=self.exit_code,
            log_path=str(self.log_path) if self.log_path else None,
            pool=self.pool,
            model=self.model,
            gpus=self.gpus,
            node=self.node,
            stays_down=self.stays_down,
            crash_loop=self.crash_loop,
        )
