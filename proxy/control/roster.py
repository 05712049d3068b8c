"""The workers one controller follows, and what its handlers read beside them.

The controller, its revival, its trials and its planning share one :class:`Roster`: the workers (each
a :class:`~proxy.control.phase.Tracked`), the journal, the clock, and the constants and rule settings
(converted again when the workers' clock rate is learned, so the handlers read them here, never a
copy). The fleet-wide questions (who is managed, who serves, is another worker down) are answered
here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from proxy.control.constants import Constants
from proxy.control.decision import Decision
from proxy.control.journal import Journal, Status
from proxy.control.phase import Tracked
from proxy.control.rules import RuleSettings
from proxy.policy import ControlMode, ControlSettings
from proxy.workers.base import WorkerId, WorkerState

__all__ = ["Roster"]


@dataclass(slots=True)
class Roster:
    """Mutable: the constants and rules change with the clock rate, the workers as the pool announces them."""

    settings: ControlSettings
    journal: Journal
    clock: Callable[[], float]
    constants: Constants  # on the clock the controller reads (the wall's)
    rules: RuleSettings
    workers: dict[WorkerId, Tracked] = field(default_factory=dict)

    @property
    def mode(self) -> ControlMode:
        return self.settings.mode

    def managed(self) -> list[Tracked]:
        return [w for w in self.workers.values() if w.managed]

    def serving_count(self) -> int:
        """Workers serving the pool now (the proxy's queue is shared among them): at least 1."""
        return max(1, sum(1 for w in self.workers.values() if w.pool_state is WorkerState.READY))

    def down_besides(self, w: Tracked | None = None) -> bool:
        """A managed worker other than ``w`` is not serving (restarting, or down): one restart at a time."""
        return any(o.managed and not o.serving for o in self.workers.values() if o is not w)

    def journal_once(
        self,
        w: Tracked,
        decision: Decision,
        key: str,
        now: float,
        *,
        status: Status,
        detail: str = "",
        span: float | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Journal a decision that is not acted on, once per ``span`` (default: the cool-down), with
        ``extra`` top-level figures."""
        span = self.constants.cooldown_s if span is None else span
        last = w.state.noted.get(key)
        if last is not None and now - last < max(span, self.constants.interval_s):
            return
        w.state = w.state.note(key, now)
        self.journal.record(decision, mode=self.mode, status=status, detail=detail, before=w.window.summary(),
                            extra=extra)  # fmt: skip
