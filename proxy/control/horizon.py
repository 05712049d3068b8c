"""The planner's horizon read from the traffic itself: how long the work just seen is expected to last.

A restart pays when what it buys while the traffic lasts beats what it costs
(:mod:`proxy.control.planner`). The deployment gives a fixed guess (``plan_horizon_s``); once work
has been waiting a while, the traffic says more:

* **the backlog's age** (:class:`Backlog`, folded over the controller's looks at a worker). A look
  with nothing waiting and room in the KV pool ends a backlog; one with the pool full does not
  (the queue was just admitted into a full pool), nor does a restart.
* **its trend** (:class:`Flow`): the slope of the work the worker holds (waiting plus running) over
  the last ``memory_s``, which changes only by arrivals and answers, unlike the waiting alone.
* **the drain**: ``waiting / answer rate`` (:func:`answer_rate`), what a gain is worth even if
  nothing more arrives.

:func:`expected_horizon` combines them. A backlog holding or growing at age ``A`` lasts ``x`` more
with chance ``A / (A + x)`` (the Lindy effect), so a gain capped at ``M`` is worth
``A ln(1 + M / A)`` plus the drain. A falling backlog ends when its waiting is gone at the slowest
fall the fit allows. The result is held between ``plan_horizon_s`` and ``plan_horizon_max_s``;
:class:`Horizon` says which case applied, for the journal's plan evidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.control.evidence import PlanHorizon
from proxy.control.planner import Observed

__all__ = ["Backlog", "Flow", "Horizon", "answer_rate", "expected_horizon"]


@dataclass(frozen=True, slots=True)
class Flow:
    """How fast the work a worker holds changed over the backlog's recent looks (least squares)."""

    slope: float  # requests per second (negative: falling)
    standard_error: float  # of the slope, from the looks' scatter about the line
    looks: int

    @property
    def falling_at_least(self) -> float | None:
        """The slowest fall (requests per second, positive) the looks allow: the slope two standard errors
        up; None where it may not be falling at all."""
        upper = self.slope + _ERRORS * self.standard_error
        return -upper if upper < 0 else None


_ERRORS = 2.0  # standard errors a fall must clear to be believed


@dataclass(frozen=True, slots=True)
class Backlog:
    """Work waiting for one worker without a break, folded over the looks at it (:meth:`observe`)."""

    since: float | None = None  # when the backlog began (None: nothing waiting at the latest look)
    waiting: float = 0.0  # requests waiting at the latest look
    looks: int = 0
    memory_s: float = 240.0  # how far back the flow is read
    held: tuple[tuple[float, float], ...] = ()  # (time, requests held: waiting + running), the last memory_s
    sharing: int = 1  # workers sharing the proxy's queue at the latest look

    def observe(
        self, time: float, waiting: float, running: float = 0.0, full: bool = False, sharing: int = 1
    ) -> Backlog:
        """The backlog after one more look: ``waiting`` requests at ``time`` (its share of the proxy's
        queue among ``sharing`` workers included) and ``running`` in the worker's batch, ``full``: its KV
        pool full at that look (nothing waiting ends the backlog unless it is full). A look at another
        number of workers sharing the queue reads the flow afresh: a worker joining or leaving moves each
        one's share, a step no arrival or answer made."""
        if waiting <= 0 and (self.since is None or not full):
            return Backlog(memory_s=self.memory_s, sharing=sharing)
        since = time if self.since is None else min(self.since, time)
        kept = self.held if sharing == self.sharing else ()
        held = (*(p for p in kept if p[0] >= time - self.memory_s), (time, waiting + running))
        return Backlog(since=since, waiting=waiting, looks=self.looks + 1, memory_s=self.memory_s, held=held,
                       sharing=sharing)  # fmt: skip

    def age(self, now: float) -> float:
        """Seconds the backlog has lasted at ``now`` (0: none)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    @property
    def flow(self) -> Flow | None:
        """The held work's slope over the last ``memory_s`` (None: fewer than three looks, or all at one
        moment)."""
        n = len(self.held)
        if n < 3:
            return None
        mean_t = sum(t for t, _ in self.held) / n
        mean_h = sum(h for _, h in self.held) / n
        spread = sum((t - mean_t) ** 2 for t, _ in self.held)
        if spread <= 1e-12:
            return None
        slope = sum((t - mean_t) * (h - mean_h) for t, h in self.held) / spread
        scatter = sum((h - mean_h - slope * (t - mean_t)) ** 2 for t, h in self.held)
        return Flow(slope=slope, standard_error=math.sqrt(scatter / (n - 2) / spread), looks=n)


def answer_rate(workload: Sequence[Observed], newest: int) -> float | None:
    """Requests the worker answers per second: the ``newest`` answered (by when they ended) over the
    time from the first of them to end to the last (None: fewer than two, or all at one moment)."""
    ends = sorted(o.finished for o in workload if o.finished is not None)[-max(2, newest) :]
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return (len(ends) - 1) / (ends[-1] - ends[0])


HorizonBasis = Literal["configured", "traffic", "longest"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Horizon:
    """The horizon a plan uses, and what the traffic said when it was chosen."""

    seconds: float  # the horizon the plan used
    basis: HorizonBasis  # configured: the floor; traffic: the backlog's expected remainder; longest: the cap
    configured_s: float  # plan_horizon_s
    expected_s: float  # what the backlog says, before the bounds (0: no backlog)
    backlog_s: float  # how long work has waited without a break (0: nothing waiting at the latest look)
    waiting: float  # requests waiting at the latest look
    drain_s: float | None  # the waiting work at the answer rate (None: no rate known)
    flow: Flow | None  # how fast the work held changed over the last looks

    @property
    def draining_s(self) -> float | None:
        """The backlog's expected remainder where the work it holds falls for sure (None: not falling)."""
        falling = self.flow is not None and self.flow.falling_at_least is not None
        return self.expected_s if falling and self.waiting > 0 else None

    def evidence(self) -> PlanHorizon:
        """The journal's plan evidence of it (rounded)."""
        falling = None if self.flow is None else self.flow.falling_at_least
        return PlanHorizon(horizon_basis=self.basis, horizon_configured_s=self.configured_s,
                           horizon_expected_s=round(self.expected_s, 1), backlog_s=round(self.backlog_s, 1),
                           waiting=round(self.waiting, 1),
                           drain_s=None if self.drain_s is None else round(self.drain_s, 1),
                           backlog_trend=None if self.flow is None else round(self.flow.slope, 4),
                           backlog_falling=None if falling is None else round(falling, 4))  # fmt: skip

    def describe(self) -> str:
        """In words, for the plan's reason."""
        if self.waiting <= 0:
            return f"horizon {self.seconds:g} s (configured: no work waiting)"
        drain = "drain unknown" if self.drain_s is None else f"{self.drain_s:.0f} s to drain"
        trend = ""
        if self.flow is not None:
            falling = self.flow.falling_at_least
            fall = "" if falling is None else f", falling at least {falling:.3f}/s"
            trend = f" (held {self.flow.slope:+.3f}/s{fall})"
        told = (
            f"work waiting for {self.backlog_s:.0f} s without a break, {self.waiting:.0f} now{trend}, {drain}: "
            f"expected {self.expected_s:.0f} s more"
        )
        how = {"configured": "configured", "longest": "the longest allowed", "traffic": "from the traffic"}[self.basis]
        return f"horizon {self.seconds:g} s {how}: {told}"


def expected_horizon(
    backlog: Backlog, now: float, rate: float | None, *, configured_s: float, longest_s: float
) -> Horizon:
    """How long the traffic just seen is expected to last (see the module docstring): the backlog's
    expected remainder at ``now`` (``rate``: requests answered per second), held between
    ``configured_s`` and ``longest_s`` (at or below ``configured_s``: the horizon is fixed)."""
    age = backlog.age(now)
    waiting = backlog.waiting if backlog.since is not None else 0.0
    drain = waiting / rate if rate is not None and rate > 0 else None
    flow = backlog.flow
    falling = None if flow is None else flow.falling_at_least
    top = max(configured_s, longest_s)
    # holding or growing: its expected remainder up to the longest horizon, then the drain
    lasting = (age * math.log1p(top / age) if age > 0 else 0.0) + (drain or 0.0)
    # falling: over when the waiting is gone at that pace
    expected = lasting if falling is None else max(drain or 0.0, min(lasting, waiting / falling))
    seconds = max(configured_s, round(min(top, expected), 1))
    basis: HorizonBasis = "configured" if seconds <= configured_s else "longest" if expected >= top else "traffic"
    return Horizon(seconds=seconds, basis=basis, configured_s=configured_s, expected_s=expected, backlog_s=age,
                   waiting=waiting, drain_s=drain, flow=flow)  # fmt: skip
