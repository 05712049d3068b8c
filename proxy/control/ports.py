"""What the controller meets at its edges, and what it hands over.

The protocols it reads the world through (the engine's log reading, the proxy around it, the
actor that restarts workers, the pool's ``declare_down``), and the values that cross them: an
:class:`Act` to carry out, a :class:`PlanJob` to compute off the loop, the actor's
:class:`ActResult` with its :class:`Drain`. Apart from the controller so that its handlers
(revival, trials, planning) and the actor (``rollout.py``) share them without importing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from proxy.control.decision import Decision
from proxy.control.horizon import Horizon
from proxy.control.planner import Expectation, InFlight, Observed, PlanInputs
from proxy.engines.contract import LogReader
from proxy.workers.base import WorkerId, WorkerInfo

__all__ = [
    "Act",
    "ActResult",
    "Actor",
    "DeathReport",
    "DeclareDown",
    "Drain",
    "EngineLogs",
    "LogReader",
    "PlanJob",
    "Surroundings",
    "TrialRefused",
]


@dataclass(frozen=True, slots=True)
class Drain:
    """What a rolling restart's drain did before the restart (the journal entry's ``act``)."""

    in_flight_at_drain: int  # requests open on the worker when it stopped getting new ones
    drained: bool  # all of them finished before the restart
    drain_s: float  # how long the drain waited
    taken_back: int = 0  # not drained: requests without output taken back to the proxy queue
    still_running_at_restart: int | None = None  # not drained: streams with output still open at the restart
    drain_stopped: str | None = None  # why the drain ended early (too few finished in a slice)

    def to_json(self) -> dict[str, object]:
        """The journal's shape: the figures that apply (``None`` ones left out)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, slots=True)
class ActResult:
    info: WorkerInfo  # the worker after the restart: READY, or DOWN if it did not come back
    drain: Drain | None = None  # a rolling restart's drain (None: a revival, nothing to drain)


class Actor(Protocol):
    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        """Rolling restart of a serving worker: drain, take back, restart, resume."""

    async def revive(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        """Restart a worker that died."""


class DeclareDown(Protocol):
    def __call__(self, worker_id: WorkerId, why: str, *, for_good: bool = True) -> object:
        """The pool's ``declare_down``: a dead worker stays down, or (``for_good`` False) loops."""


class DeathReport(Protocol):
    """Why a worker died, as its engine reads the log tail (``proxy.engines.<engine>.logs.Death``)."""

    @property
    def cause(self) -> str: ...  # "oom", "crash", "watchdog", "kv_capacity"... or "unknown"

    @property
    def phase(self) -> str: ...  # for "oom": "prefill", "decode" or "unknown"

    @property
    def detail(self) -> str: ...  # the exception or line that says so


class EngineLogs(Protocol):
    """What the controller reads through the engine's module."""

    def log_reader(self) -> LogReader:
        """A reader for one worker's log lines (a new one per worker: a reader may keep state)."""

    def classify_death(self, tail: Sequence[str]) -> DeathReport | None:
        """Why a worker died, from the last lines of its log; None: this engine cannot tell."""


class Surroundings(Protocol):
    """What the controller reads of the proxy around it, and what it sets there: an output budget held
    back while its gain is measured, and the most requests a worker holds open."""

    def log_tail(self, worker_id: WorkerId, lines: int) -> Sequence[str]:
        """The last ``lines`` lines of a worker's output (none for a worker this proxy did not start)."""

    def backlog(self) -> int:
        """Requests waiting in the proxy's own queue."""

    def held_for_class(self) -> int:
        """Of those, the batch requests their class's own gates hold there beside interactive work (by
        design, not for want of room in the band)."""

    def recent_requests(self, worker_id: WorkerId) -> Sequence[Observed]:
        """The worker's newest answered requests, as the proxy saw them (the planner's workload)."""

    def in_flight(self, worker_id: WorkerId) -> Sequence[InFlight]:
        """The requests the proxy has open on the worker now (running or queued there)."""

    def queue_gate(self, worker_id: WorkerId) -> tuple[int, float] | None:
        """The server queue the proxy's gate keeps at the worker (interactive work's), and how often it
        looks at it in the worker's seconds; None: not known."""

    def prefix_first(self, worker_id: WorkerId) -> int:
        """How many times in a row the proxy's queue passes over its oldest request for the worker's pool
        to send one whose prefix runs on a worker (0: arrival order)."""

    def prefixes_shared(self, worker_id: WorkerId) -> bool:
        """Whether two requests the proxy holds for the worker's pool carry the same prompt prefix."""

    def queue_sides(self, worker_id: WorkerId) -> tuple[int, int] | None:
        """The queues the gate may keep at the worker at and past its engine's prefix limit; None: no
        such limit (:mod:`proxy.control.queue_side`)."""

    def keep_queue_past(self, worker_id: WorkerId, past: bool) -> None:
        """Keep the worker's queue past its engine's prefix limit (``past``), else at it."""

    def hold_back_budget(self, worker_id: WorkerId, interactive: bool, asked: int, tokens: int | None) -> None:
        """Send the class's requests asking for ``asked`` to the worker with ``tokens`` (None: as asked)
        instead of at their output budget, until :meth:`release_budget`."""

    def release_budget(self, worker_id: WorkerId, interactive: bool, asked: int) -> None:
        """Send them at their output budget again."""

    def hold_open(self, worker_id: WorkerId, most: int | None) -> None:
        """Keep at most ``most`` requests open on the worker (the batch its CUDA graphs cover, where the
        planner's twin priced it a gain: :mod:`proxy.control.hold`); None: no such hold."""


class TrialRefused(Exception):
    """An operator's trial cannot start now; the message says why, ``code`` names it."""

    def __init__(self, message: str, *, code: str = "trial_refused") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PlanJob:
    """A plan to compute for one worker (:func:`~proxy.control.planner.run_plan` on ``inputs``)."""

    worker_id: WorkerId
    time: float
    inputs: PlanInputs
    measured_throughput: float | None
    horizon: Horizon  # the horizon its plan uses, and what the traffic said


@dataclass(frozen=True, slots=True)
class Act:
    """A decision to carry out (:meth:`Controller.carry_out`), journaled as ``acting`` under ``entry_id``."""

    decision: Decision
    entry_id: int
    revival: bool = False  # the worker died: nothing to drain
    # once the worker serves again, how long before its outcome window opens: a planner's restart
    # first computes again the work it took back (a window over that measures the restart, not the args)
    settle_s: float = 0.0
    expectation: Expectation | None = None  # a plan's: what the twin expects of the new args
