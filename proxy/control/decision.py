"""What a rule decides (:class:`Decision`) and what the controller remembers per worker (:class:`ControlState`).

Both are frozen values. A decision carries its rule's evidence (``proxy.control.evidence``) and,
when it moves one knob, that move (:class:`KnobChange`). The controller replaces a worker's state
after each act (``state.after_restart(decision, now)``), so rules stay pure functions of (window,
state, settings).

Rules come in three kinds, which the gate (``proxy.control.rules.gate``) treats differently:

| kind | examples | cool-down, restart budget | may move a knob back |
|---|---|---|---|
| ``safety`` | OOM, crash loop | ignored (the worker is down anyway) | yes |
| ``corrective`` | retraction storm, too little free memory | apply | once: the way back is then blocked for ``flip_guard_s`` |
| ``tuning`` | admission too conservative, memory to spare | apply | never within ``flip_guard_s`` |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import TypeVar

from proxy.control.evidence import NO_EVIDENCE, Evidence, JsonScalar
from proxy.engines.base import Knob

__all__ = ["Action", "ControlState", "Decision", "KnobChange", "KnobMove", "RuleKind"]

HOUR = 3600.0
_K = TypeVar("_K")
_V = TypeVar("_V")


class Action(StrEnum):
    RESTART = "restart"  # restart the worker with new_args
    NOTE = "note"  # only journaled (an observation the front door's own loop answers)


class RuleKind(StrEnum):
    SAFETY = "safety"
    CORRECTIVE = "corrective"
    TUNING = "tuning"


def _frozen(mapping: Mapping[_K, _V] | None = None) -> Mapping[_K, _V]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, slots=True, kw_only=True)
class KnobChange:
    """The one knob a decision moves: ``arg`` (the engine's name for ``knob``) from ``old`` to ``new``."""

    knob: str
    arg: str
    old: float | None  # None: unset and unknown
    new: float
    direction: int  # +1 raised, -1 lowered

    def to_json(self) -> dict[str, JsonScalar]:
        return {"knob": self.knob, "arg": self.arg, "old_value": self.old, "new_value": self.new}


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    worker_id: str
    rule: str
    reason: str  # one sentence an operator reads in the journal
    time: float  # monotonic
    evidence: Evidence = NO_EVIDENCE  # the figures that triggered it
    old_args: Mapping[str, object] = field(default_factory=_frozen)
    new_args: Mapping[str, object] = field(default_factory=_frozen)
    action: Action = Action.RESTART
    kind: RuleKind = RuleKind.TUNING
    change: KnobChange | None = None  # the knob moved (None: several, or none)
    delay_s: float = 0.0  # wait this long before acting (crash back-off)

    @property
    def knob(self) -> str | None:
        return self.change.knob if self.change is not None else None

    @property
    def direction(self) -> int:
        """+1 raised, -1 lowered, 0 several knobs or none."""
        return self.change.direction if self.change is not None else 0

    @property
    def changes(self) -> dict[str, tuple[object, object]]:
        """``arg -> (old, new)`` for every argument that differs."""
        keys = set(self.old_args) | set(self.new_args)
        return {
            k: (self.old_args.get(k), self.new_args.get(k))
            for k in sorted(keys)
            if self.old_args.get(k) != self.new_args.get(k)
        }

    def evidence_json(self) -> dict[str, JsonScalar]:
        """The evidence as the journal writes it: the rule's figures and the knob change."""
        return {**self.evidence.to_json(), **(self.change.to_json() if self.change is not None else {})}


@dataclass(frozen=True, slots=True, kw_only=True)
class KnobMove:
    """A knob's last move, as the state remembers it."""

    time: float
    direction: int
    old: float | None
    new: float
    rule: str
    evidence: Evidence = NO_EVIDENCE  # the figures the move was made on


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlState:
    """What the controller remembers about one worker between rule evaluations."""

    worker_id: str
    args: Mapping[str, object] = field(default_factory=_frozen)  # what the worker runs with now
    initial_args: Mapping[str, object] = field(default_factory=_frozen)  # the policy's args
    resolved: Mapping[str, float] = field(default_factory=_frozen)  # values the engine chose for unset args
    started_at: float | None = None  # when the current incarnation began serving
    last_restart: float | None = None  # the last restart the controller asked for
    restarts: tuple[float, ...] = ()  # times of the controller's restarts (last hour kept)
    deaths: tuple[float, ...] = ()  # times the worker died on its own
    moves: Mapping[str, KnobMove] = field(default_factory=_frozen)  # the last move of each knob
    blocked: Mapping[str, float] = field(default_factory=_frozen)  # "knob:+1" -> until (monotonic)
    last_good_args: Mapping[str, object] | None = None  # args that ran good_after_s without dying
    noted: Mapping[str, float] = field(default_factory=_frozen)  # journal key -> last time written
    crash_loop_noted: bool = False  # the crash loop it is in was journaled (until a death ends the loop)

    @classmethod
    def initial(cls, worker_id: str, args: Mapping[str, object], now: float | None = None) -> ControlState:
        return cls(worker_id=worker_id, args=_frozen(args), initial_args=_frozen(args), started_at=now)

    # -- reading --------------------------------------------------------------------------------

    def current(self, knob: Knob) -> float | None:
        """The knob's value now: the arg if set, else what the engine resolved, else its default."""
        value = self.args.get(knob.arg)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if knob.resolved_field and knob.resolved_field in self.resolved:
            return self.resolved[knob.resolved_field]
        return knob.default

    def restarts_within(self, now: float, span_s: float = HOUR) -> int:
        return sum(1 for t in self.restarts if t > now - span_s)

    def deaths_within(self, now: float, span_s: float) -> int:
        return sum(1 for t in self.deaths if t > now - span_s)

    def blocked_until(self, knob: str, direction: int) -> float | None:
        return self.blocked.get(f"{knob}:{direction:+d}")

    # -- changing -------------------------------------------------------------------------------

    def with_resolved(self, values: Mapping[str, float]) -> ControlState:
        return replace(self, resolved=_frozen({**self.resolved, **values}))

    def without_resolved(self) -> ControlState:
        """A new incarnation starts: it will report the values it resolves itself."""
        return replace(self, resolved=_frozen({}))

    def after_restart(self, decision: Decision, now: float, flip_guard_s: float) -> ControlState:
        """The worker was restarted with ``decision.new_args``."""
        moves = dict(self.moves)
        blocked = {k: until for k, until in self.blocked.items() if until > now}
        change = decision.change
        if change is not None and change.direction:
            previous = moves.get(change.knob)
            reversal = (
                previous is not None and previous.direction == -change.direction and now - previous.time < flip_guard_s
            )
            if reversal:  # settle: the way this knob just came back from stays shut for a while
                blocked[f"{change.knob}:{-change.direction:+d}"] = now + flip_guard_s
            moves[change.knob] = KnobMove(
                time=now,
                direction=change.direction,
                old=float(change.old) if change.old is not None else None,
                new=float(change.new),
                rule=decision.rule,
                evidence=decision.evidence,
            )
        elif (
            change is None and decision.kind is RuleKind.SAFETY and decision.changes
        ):  # a revert: hold every moved knob
            for knob, move in moves.items():
                blocked[f"{knob}:{move.direction:+d}"] = now + flip_guard_s
        return replace(
            self,
            args=_frozen(decision.new_args),
            last_restart=now,
            restarts=(*(t for t in self.restarts if t > now - HOUR), now),
            moves=_frozen(moves),
            blocked=_frozen(blocked),
            started_at=None,
        )

    def after_death(self, now: float) -> ControlState:
        return replace(self, deaths=(*(t for t in self.deaths if t > now - HOUR), now), started_at=None)

    def serving(self, now: float) -> ControlState:
        return replace(self, started_at=now)

    def mark_good(self) -> ControlState:
        return replace(self, last_good_args=_frozen(self.args))

    def note(self, key: str, now: float) -> ControlState:
        return replace(self, noted=_frozen({**self.noted, key: now}))

    def with_crash_loop_noted(self, noted: bool) -> ControlState:
        return replace(self, crash_loop_noted=noted)
