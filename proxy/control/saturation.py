"""A worker's pace while work waited for it: its output rate over its saturated, settled scrapes.

A change that lets the engine admit more (an output budget) shows in what the worker writes while
admission limits it, so its measure reads only the time between two scrapes that each saw work
waiting (its server queue non-empty, or the proxy holding requests for it that the band would send).
A run of such scrapes begins with the engine filling its batch (an engine that was idle admits
afresh: SGLang resets how much room it reserves for each request), so its first ``settle_s`` is
not read either: the pace is the settled one on both sides of a decision, not a load's ramp-up.
Pure: samples and the proxy's looks in, a :class:`Pace` out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import pairwise

from proxy.control.window import Window
from proxy.engines.base import Sample

__all__ = ["Pace", "saturated_pace"]


@dataclass(frozen=True, slots=True)
class Pace:
    """Output tokens over the settled saturated seconds read, and when the run of saturated scrapes
    the window ends in began (None: no work waited at its last scrape)."""

    seconds: float = 0.0
    tokens: float = 0.0
    run_began: float | None = None

    @property
    def tok_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def _runs(window: Window, until: float, began: float | None) -> list[tuple[float, list[Sample]]]:
    """The runs of consecutive scrapes up to ``until`` that saw work waiting (its server queue, or the
    proxy's latest look then), each with when it began: a run the window opens in, at ``began`` where
    given (the caller saw it earlier), else at its first scrape."""
    looks = sorted(window.proxy_queue)
    times = [t for t, _, _ in looks]
    runs: list[tuple[float, list[Sample]]] = []
    waiting_before = False
    for k, s in enumerate(x for x in window.samples if x.time <= until):
        i = bisect.bisect_right(times, s.time) - 1
        held = looks[i][1] - looks[i][2] if i >= 0 else 0
        waiting = s.queue > 0 or held > 0
        if waiting and not waiting_before:
            runs.append((began if k == 0 and began is not None and began <= s.time else s.time, []))
        if waiting:
            runs[-1][1].append(s)
        waiting_before = waiting
    return runs


def _tokens(a: Sample, b: Sample) -> float | None:
    """Output tokens written between two scrapes: the counter's rise, else the gauge at the second."""
    if a.generation_tokens_total is not None and b.generation_tokens_total is not None:
        rise = b.generation_tokens_total - a.generation_tokens_total
        return rise if rise >= 0 else None  # a drop: the engine restarted in between
    return b.gen_throughput * (b.time - a.time) if b.gen_throughput is not None else None


def saturated_pace(
    window: Window,
    since: float,
    until: float,
    *,
    settle_s: float,
    enough_s: float | None = None,
    began: float | None = None,
) -> Pace:
    """The worker's settled saturated pace over [``since``, ``until``] of ``window`` (see the module's
    words); with ``enough_s``, only the newest such time until that much is read (the nearest to a
    decision); ``began``: when a run the window opens in began, where the caller knows."""
    runs = _runs(window, until, began)
    spans = [
        (b.time - a.time, tokens)
        for start, run in runs
        for a, b in pairwise(run)
        if a.time >= max(since, start + settle_s) and (tokens := _tokens(a, b)) is not None
    ]
    seconds = total = 0.0
    for dt, tokens in reversed(spans):
        if enough_s is not None and seconds >= enough_s:
            break
        seconds, total = seconds + dt, total + tokens
    last = [s for s in window.samples if s.time <= until][-1:]
    ongoing = bool(runs) and bool(last) and runs[-1][1][-1] is last[0]
    return Pace(seconds=seconds, tokens=total, run_began=runs[-1][0] if ongoing else None)
