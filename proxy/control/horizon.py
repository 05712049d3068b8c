"""The planner's horizon read from the traffic itself: how long the work just seen is expected to last.

A restart pays when what it buys over the time the traffic that makes the gain lasts beats what it
costs (:mod:`proxy.control.planner`). The deployment says how long it expects traffic it has not
seen to last (``plan_horizon_s``). Once work has been waiting for a while, the traffic says more:

* **the backlog's age.** :class:`Backlog` is folded over the controller's looks at a worker (each
  scrape: the requests in the server's queue plus the worker's share of those in the proxy's
  queue). A backlog begins at the first look with work waiting and lasts while every look finds
  some; one look with nothing waiting and room in the KV pool ends it (the worker caught up: what
  comes next is a new backlog), so waiting that comes and goes with the noise of the arrivals never
  grows old. A look with nothing waiting and the pool full (token usage at the policy's
  ``low_usage`` or above) does not: the worker has just admitted its whole queue into a full pool,
  and what it retracts or what arrives next waits again (in a recorded retraction storm, the one
  empty look of an hour's backlog was at usage 0.95; those of a worker keeping up were at 0.55-0.74).
  A restart does not end it either: the traffic is the same, the requests taken back wait in the proxy.
* **its trend.** The fold keeps the least-squares sums of (seconds into the backlog, requests
  waiting), so the backlog's growth in requests per second is known without keeping the looks.
* **the drain.** The work waiting now takes ``waiting / answer rate`` seconds at the rate the worker
  answers (:func:`answer_rate`, over the plan's own sample of answered requests) even if nothing
  more arrives: a gain in throughput is worth that long whatever the traffic does next.

:func:`expected_horizon` combines them. A backlog holding or growing at age ``A``: with nothing known
of how long such a backlog lasts but that this one has reached its age, the chance that it lasts
``x`` more is ``A / (A + x)`` (Gott's argument, the Lindy effect: its median remainder is its age). A
restart's gain accrues while it lasts, up to the longest horizon ``M`` the deployment allows, so
what the gain is worth is its expected length there, ``E[min(remainder, M)] = A ln(1 + M / A)``, and
then the drain: ``A ln(1 + M / A) + drain``. The median (``A``) was the first build's: it ignored
that a backlog which has lasted ``A`` lasts much longer than ``A`` often enough to count, and the
plan weighs a gain against a cost by expectation (in retraction-storm's hour a restart that pays
at the expected horizon pays from about 560 modelled s; at the median, from 1,374 s). A backlog that shrinks at ``r`` requests per second is over in
``waiting / r`` (no less than the drain, no more than the above). The horizon is that, held
between the configured horizon (the floor: no backlog, or a passing one, is planned exactly as with
the fixed setting) and ``plan_horizon_max_s`` (the most the traffic can earn); :class:`Horizon`
says which of the three it was and why, for the journal's plan evidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.control.evidence import PlanHorizon
from proxy.control.planner import Observed

__all__ = ["Backlog", "Horizon", "answer_rate", "expected_horizon"]


@dataclass(frozen=True, slots=True)
class Backlog:
    """Work waiting for one worker without a break, folded over the looks at it (:meth:`observe`)."""

    since: float | None = None  # when the backlog began (None: nothing waiting at the latest look)
    waiting: float = 0.0  # requests waiting at the latest look
    looks: int = 0
    # least-squares sums over the backlog's looks of t (seconds since ``since``) and w (requests waiting)
    sum_t: float = 0.0
    sum_w: float = 0.0
    sum_tt: float = 0.0
    sum_tw: float = 0.0

    def observe(self, time: float, waiting: float, full: bool = False) -> Backlog:
        """The backlog after one more look: ``waiting`` requests at ``time``, ``full``: the worker's KV
        pool full at that look (nothing waiting ends the backlog unless the pool is full)."""
        if waiting <= 0 and (self.since is None or not full):
            return Backlog()
        since = time if self.since is None else min(self.since, time)
        t = time - since
        return Backlog(since=since, waiting=waiting, looks=self.looks + 1, sum_t=self.sum_t + t,
                       sum_w=self.sum_w + waiting, sum_tt=self.sum_tt + t * t,
                       sum_tw=self.sum_tw + t * waiting)  # fmt: skip

    def age(self, now: float) -> float:
        """Seconds the backlog has lasted at ``now`` (0: none)."""
        return 0.0 if self.since is None else max(0.0, now - self.since)

    @property
    def trend(self) -> float | None:
        """Requests per second the waiting grew (negative: shrank) over the backlog, by least squares
        (None: fewer than two looks, or all at one moment)."""
        n = self.looks
        spread = n * self.sum_tt - self.sum_t * self.sum_t
        if n < 2 or spread <= 1e-12:
            return None
        return (n * self.sum_tw - self.sum_t * self.sum_w) / spread


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
    trend: float | None  # requests per second the backlog grew (negative: shrank)

    def evidence(self) -> PlanHorizon:
        """The journal's plan evidence of it (rounded)."""
        return PlanHorizon(horizon_basis=self.basis, horizon_configured_s=self.configured_s,
                           horizon_expected_s=round(self.expected_s, 1), backlog_s=round(self.backlog_s, 1),
                           waiting=round(self.waiting, 1),
                           drain_s=None if self.drain_s is None else round(self.drain_s, 1),
                           backlog_trend=None if self.trend is None else round(self.trend, 4))  # fmt: skip

    def describe(self) -> str:
        """In words, for the plan's reason."""
        if self.waiting <= 0:
            return f"horizon {self.seconds:g} s (configured: no work waiting)"
        drain = "drain unknown" if self.drain_s is None else f"{self.drain_s:.0f} s to drain"
        trend = "" if self.trend is None else f" ({self.trend:+.3f}/s)"
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
    trend = backlog.trend
    top = max(configured_s, longest_s)
    # holding or growing: its expected remainder up to the longest horizon, then the drain
    lasting = (age * math.log1p(top / age) if age > 0 else 0.0) + (drain or 0.0)
    shrinking = trend is not None and trend < 0  # over when the waiting is gone at that pace
    expected = max(drain or 0.0, min(lasting, waiting / -trend)) if shrinking and trend is not None else lasting
    seconds = max(configured_s, round(min(top, expected), 1))
    basis: HorizonBasis = "configured" if seconds <= configured_s else "longest" if expected >= top else "traffic"
    return Horizon(seconds=seconds, basis=basis, configured_s=configured_s, expected_s=expected, backlog_s=age,
                   waiting=waiting, drain_s=drain, trend=trend)  # fmt: skip
