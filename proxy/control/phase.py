"""Where each worker stands for the controller: one :class:`Phase`, moved only along :data:`MOVES`.

A worker is down (not up since its launch, its death or a restart that failed), held (launched,
its start-up line foresaw a crash), serving, planning (serving, its plan computed off the loop)
or acting (a restart or a revival decided, until the actor returns). Each handler asks the phase
what it may do (a rule acts only on a serving worker, one act at a time), and every change goes
through :meth:`Tracked.move`, which refuses a move the table does not list: two acts at once on
one worker, or a plan decided for a worker that is not serving, fail loudly instead of quietly.

:class:`Tracked` is the rest of what the controller keeps per worker: its window and state, its
log reader, the outcome its last restart (and its budgets) await, its start-up and drain as measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.control.budget_gain import Cohort
from proxy.control.budget_outcome import PendingBudget
from proxy.control.decision import ControlState
from proxy.control.horizon import Backlog
from proxy.control.outcomes import PendingCheck, PendingOutcome
from proxy.control.planner import Looks
from proxy.control.window import Window
from proxy.engines.contract import LogReader
from proxy.workers.base import WorkerState

__all__ = ["MOVES", "Phase", "PhaseError", "Tracked"]


class Phase(StrEnum):
    DOWN = "down"  # not serving: not up since its launch, its death or a restart that failed (or left down)
    HELD = "held"  # launched, its start-up line foresaw a crash: held, it comes up DRAINING and is restarted
    SERVING = "serving"
    PLANNING = "planning"  # serving, its plan being computed off the loop
    ACTING = "acting"  # a restart or a revival decided, until the actor returns

    @property
    def serving(self) -> bool:
        """Up and not acting: the rules, the planner and the canary read it."""
        return self in (Phase.SERVING, Phase.PLANNING)


# each phase's moves; a move not listed is a bug in the controller (PhaseError)
MOVES: Mapping[Phase, frozenset[Phase]] = {
    # up (READY); held by its start-up line; its revival decided; a death while down (a crash loop)
    Phase.DOWN: frozenset({Phase.SERVING, Phase.HELD, Phase.ACTING, Phase.DOWN}),
    # up DRAINING (the tick restarts it); gone, or died, before it came up
    Phase.HELD: frozenset({Phase.SERVING, Phase.DOWN}),
    # a plan computed off the loop; a restart (a rule, a canary, a trial); a death (down, then revived)
    Phase.SERVING: frozenset({Phase.PLANNING, Phase.ACTING, Phase.DOWN}),
    # the plan decided (or failed); as serving meanwhile (a plan whose worker restarted is dropped)
    Phase.PLANNING: frozenset({Phase.SERVING, Phase.ACTING, Phase.DOWN}),
    # the actor returned: up, or not (a death then decides the revival); a refused restart: as it was
    Phase.ACTING: frozenset({Phase.SERVING, Phase.DOWN}),
}


class PhaseError(RuntimeError):
    """A move :data:`MOVES` does not list: the controller's bookkeeping went wrong."""


@dataclass(slots=True)
class Tracked:
    """One worker as the controller follows it (mutable: the controller's own record, not shared)."""

    state: ControlState
    window: Window
    reader: LogReader | None  # None: not managed, no log to read
    managed: bool
    phase: Phase
    pending_outcome: PendingOutcome | None = None  # the last restart's, until its window is in
    pending_check: PendingCheck | None = None  # the last acted plan's twin, until enough is answered
    # its output budgets set or moved, each until its check (with it, then held back) is done
    pending_budgets: dict[Cohort, PendingBudget] = field(default_factory=dict)
    starting_at: float | None = None  # when its current start began (to measure the start-up)
    startup_s: float | None = None  # its last start-up, launch to ready, as seen
    drain_s: float = 0.0  # its last drain before a restart
    last_plan: float = float("-inf")
    looks: Looks = field(default_factory=Looks)  # what its plans under the current args said (a restart: afresh)
    held_open: int | None = None  # the hold at its CUDA graphs' batch its last look set (a restart: none)
    queue_past: bool = False  # its queue kept past its engine's prefix limit by its looks (a restart: at it)
    pool_state: WorkerState = WorkerState.READY  # as the pool last announced it
    # work waiting for it without a break (kept across its restarts: it is the traffic's)
    backlog: Backlog = field(default_factory=Backlog)

    @property
    def serving(self) -> bool:
        return self.phase.serving

    @property
    def serving_since(self) -> float | None:
        """When its current incarnation began serving, while it serves; else None."""
        return self.state.started_at if self.phase.serving else None

    def move(self, to: Phase) -> None:
        """Into phase ``to``; :class:`PhaseError` where :data:`MOVES` does not allow it."""
        if to not in MOVES[self.phase]:
            raise PhaseError(f"worker {self.state.worker_id}: no move from {self.phase} to {to}")
        self.phase = to

    def plan_done(self) -> None:
        """Its plan is decided (or failed): back to serving, unless something else moved it meanwhile."""
        if self.phase is Phase.PLANNING:
            self.move(Phase.SERVING)
