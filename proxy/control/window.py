"""A bounded window of one worker's recent samples and log events, and the figures rules read.

A :class:`Window` is an immutable value: ``push`` returns a new window holding the item and
dropping what fell out of the last ``span_s`` seconds, so rules never see a window change under
them. Evidence starts at ``since``, when the worker's current incarnation began to serve
(:meth:`Window.restart` empties it, :meth:`Window.begin` keeps only the start-up line).

Derived figures, each ``None`` (or 0) when nothing was seen:

* ``retraction_rate_per_min``: the larger of the retraction counter's and the log lines' rates;
* ``conservative_fraction(low_usage)``: share of observations queueing below ``low_usage``;
* ``retractions_per_1k_tokens``: retracted requests per 1,000 output tokens;
* ``waiting_usage``: mean token usage while the server queue is non-empty;
* ``throughput``: output tokens/s; ``peak_running``: the largest running batch;
* ``kv_capacity_tokens``: the KV pool's latest reported capacity;
* ``mean_request_tokens``: mean prompt + output tokens of the requests finished in the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TypeVar

from proxy.engines.base import EventKind, LogEvent, Sample

__all__ = ["Window"]

_MINUTE = 60.0
_T = TypeVar("_T", Sample, LogEvent)


def _counter_increase(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(increase, seconds covered) of a counter over ``(time, value)`` points; a drop is a reset."""
    if len(points) < 2:
        return None
    total = 0.0
    for (_, before), (_, after) in pairwise(points):
        total += after - before if after >= before else after
    return total, points[-1][0] - points[0][0]


@dataclass(frozen=True, slots=True)
class Window:
    span_s: float = 60.0
    since: float = float("-inf")  # evidence before this time is ignored
    now: float = float("-inf")  # the latest time seen
    samples: tuple[Sample, ...] = ()
    events: tuple[LogEvent, ...] = ()
    startup: LogEvent | None = None  # the current incarnation's start-up line (kept past span_s)
    # (time, requests the proxy holds for this pool, of which its batch class's own gates hold)
    proxy_queue: tuple[tuple[float, int, int], ...] = ()

    # -- building -------------------------------------------------------------------------------

    def push(self, item: Sample | LogEvent) -> Window:
        """The window with one more sample or event (older than ``since``: ignored)."""
        if item.time < self.since:
            return self
        now = max(self.now, item.time)
        if isinstance(item, Sample):
            return replace(
                self, now=now, samples=(*self._keep(self.samples, now), item), events=self._keep(self.events, now)
            )
        startup = item if item.kind is EventKind.STARTUP else self.startup
        return replace(
            self,
            now=now,
            samples=self._keep(self.samples, now),
            events=(*self._keep(self.events, now), item),
            startup=startup,
        )

    def push_all(self, items: Iterable[Sample | LogEvent]) -> Window:
        window = self
        for item in items:
            window = window.push(item)
        return window

    def push_proxy_queue(self, time: float, depth: int, for_class: int = 0) -> Window:
        """The window with one more look at the proxy's queue: ``depth`` requests held, ``for_class`` of
        them by their class's own gates (batch work beside interactive work)."""
        if time < self.since:
            return self
        now = max(self.now, time)
        kept = tuple(p for p in self.proxy_queue if p[0] >= now - self.span_s)
        return replace(self, now=now, proxy_queue=(*kept, (time, depth, min(for_class, depth))))

    def at(self, now: float) -> Window:
        """The window as of ``now``: what fell out of the span is dropped."""
        now = max(self.now, now)
        return replace(
            self,
            now=now,
            samples=self._keep(self.samples, now),
            events=self._keep(self.events, now),
            proxy_queue=tuple(p for p in self.proxy_queue if p[0] >= now - self.span_s),
        )

    def after(self, start: float) -> Window:
        """The window's evidence from ``start`` on (what a worker did once a phase of it was over)."""
        if start <= self.since:
            return self
        return replace(
            self,
            since=start,
            samples=tuple(s for s in self.samples if s.time >= start),
            events=tuple(e for e in self.events if e.time >= start),
            proxy_queue=tuple(p for p in self.proxy_queue if p[0] >= start),
        )

    def busy(self) -> Window:
        """The window's evidence while the worker had work: from its first sample with a request running
        or queued to its last (the idle seconds before a load arrived, or after it ended, say nothing of
        how fast it served it). The window as it is where no sample says."""
        times = [s.time for s in self.samples if s.running > 0 or s.queue > 0]
        if not times:
            return self
        first, last = times[0], times[-1]
        return replace(
            self,
            since=max(self.since, first),
            now=last,
            samples=tuple(s for s in self.samples if first <= s.time <= last),
            events=tuple(e for e in self.events if first <= e.time <= last),
            proxy_queue=tuple(p for p in self.proxy_queue if first <= p[0] <= last),
        )

    def restart(self, at: float) -> Window:
        """A restart begins: nothing seen so far describes the next incarnation."""
        return Window(span_s=self.span_s, since=at, now=max(self.now, at))

    def begin(self, at: float) -> Window:
        """The worker serves again from ``at``: drop the start-up phase, keep the start-up line."""
        startup = self.startup if self.startup is not None and self.startup.time >= self.since else None
        return Window(span_s=self.span_s, since=at, now=max(self.now, at), startup=startup)

    def _keep(self, items: tuple[_T, ...], now: float) -> tuple[_T, ...]:
        horizon = now - self.span_s
        if not items or items[0].time >= horizon:
            return items
        return tuple(i for i in items if i.time >= horizon)

    # -- figures --------------------------------------------------------------------------------

    @property
    def observed_s(self) -> float:
        """How much time the window's evidence covers: from its oldest item to ``now``."""
        times = [x[0].time for x in (self.samples, self.events) if x]
        if not times:
            return 0.0
        return min(self.span_s, self.now - min(times))

    def of_kind(self, kind: EventKind) -> tuple[LogEvent, ...]:
        return tuple(e for e in self.events if e.kind is kind)

    @property
    def retractions(self) -> int:
        """Requests retracted in the window, by log lines (the counter where no line was seen)."""
        logged = sum(
            int(e.fields.get("retracted", 1)) for e in self.of_kind(EventKind.RETRACTION) if not e.fields.get("forced")
        )
        counted = _counter_increase(
            [(s.time, s.retractions_total) for s in self.samples if s.retractions_total is not None]
        )
        return max(logged, int(counted[0]) if counted else 0)

    @property
    def retraction_rate_per_min(self) -> float:
        rates = [0.0]
        counted = _counter_increase(
            [(s.time, s.retractions_total) for s in self.samples if s.retractions_total is not None]
        )
        if counted and counted[1] > 0:
            rates.append(counted[0] / counted[1] * _MINUTE)
        logged = sum(
            int(e.fields.get("retracted", 1)) for e in self.of_kind(EventKind.RETRACTION) if not e.fields.get("forced")
        )
        if logged and self.observed_s > 0:
            rates.append(logged / max(self.observed_s, 1.0) * _MINUTE)
        return max(rates)

    @property
    def retractions_per_1k_tokens(self) -> float | None:
        tp = self.throughput
        if tp is None or tp <= 0:
            return None
        return self.retraction_rate_per_min / (tp * _MINUTE / 1000.0)

    def _load_points(self) -> list[tuple[int, float, int]]:
        """(queue, token usage, running) per observation: samples, else the statistics log lines."""
        if self.samples:
            return [(s.queue, s.token_usage, s.running) for s in self.samples]
        points = []
        for e in self.of_kind(EventKind.BATCH_STATS):
            f = e.fields
            if isinstance(f.get("queue"), int) and isinstance(f.get("token_usage"), (int, float)):
                points.append((int(f["queue"]), float(f["token_usage"]), int(f.get("running", 0))))
        return points

    def conservative_fraction(self, low_usage: float) -> float:
        """Share of observations with queue > 0 and token usage < ``low_usage``."""
        points = self._load_points()
        if not points:
            return 0.0
        return sum(1 for q, u, _ in points if q > 0 and u < low_usage) / len(points)

    def waiting_usage(self) -> float | None:
        """Mean token usage of the observations with a non-empty server queue (None: none had one)."""
        usage = [u for q, u, _ in self._load_points() if q > 0]
        return sum(usage) / len(usage) if usage else None

    def at_cap_fraction(self, cap: float | None) -> float:
        """Share of observations whose running batch is at ``cap`` (>= 95 % of it)."""
        points = self._load_points()
        if not points or not cap:
            return 0.0
        return sum(1 for _, _, r in points if r >= 0.95 * cap) / len(points)

    def _held_by_sample(self) -> list[tuple[Sample, int]]:
        """Each sample with the requests the proxy held for the worker then that the band would send
        (the batch its class's gates hold beside interactive work waits by design; 0: none reported)."""
        out, held, queue = [], 0, iter(self.proxy_queue)
        pending = next(queue, None)
        for s in self.samples:
            while pending is not None and pending[0] <= s.time:
                held = pending[1] - pending[2]
                pending = next(queue, None)
            out.append((s, held))
        return out

    def timid_fraction(self) -> float:
        """Share of samples with an empty server queue while the proxy held requests back that the band
        would send (the batch its class's gates hold beside interactive work waits by design)."""
        if not self.samples or not self.proxy_queue:
            return 0.0
        return sum(1 for s, held in self._held_by_sample() if s.queue == 0 and held > 0) / len(self.samples)

    def busy_share(self, full: float) -> float:
        """Share of samples at which work waited for the worker (in its queue, or let through by the band
        in the proxy's) or its KV pool was ``full``: the share of the window its rate is its capacity."""
        if not self.samples:
            return 0.0
        busy = sum(1 for s, held in self._held_by_sample() if s.queue > 0 or s.token_usage >= full or held > 0)
        return busy / len(self.samples)

    @property
    def proxy_backlog(self) -> int | None:
        """Requests the proxy held at its latest look (None: not reported)."""
        return self.proxy_queue[-1][1] if self.proxy_queue else None

    @property
    def throughput(self) -> float | None:
        """Output tokens per second over the window."""
        counted = _counter_increase(
            [(s.time, s.generation_tokens_total) for s in self.samples if s.generation_tokens_total is not None]
        )
        if counted and counted[1] > 0:
            return counted[0] / counted[1]
        return self._mean_gen_throughput()

    def _mean_gen_throughput(self) -> float | None:
        """The mean of the engine's generation-throughput gauge over the window's samples (its decode
        statistics lines where no sample carries it); None when neither says."""
        gauges = [s.gen_throughput for s in self.samples if s.gen_throughput is not None]
        if not gauges:
            gauges = [
                float(e.fields["gen_throughput"])
                for e in self.of_kind(EventKind.BATCH_STATS)
                if isinstance(e.fields.get("gen_throughput"), (int, float))
            ]
        return sum(gauges) / len(gauges) if gauges else None

    @property
    def decode_rate(self) -> float | None:
        """Output tokens/s as the engine produces them: the mean of its generation-throughput gauge over
        the window's samples (its decode statistics lines without samples), else :attr:`throughput`.
        The finished-token counter behind :attr:`throughput` moves only when a request ends, so over a
        short window a worker running a few long outputs reads as idle, and one that just started as
        faster than it is; the gauge counts tokens as they are decoded."""
        rate = self._mean_gen_throughput()
        return rate if rate is not None else self.throughput

    @property
    def mean_running(self) -> float | None:
        """The mean running batch over the window's samples (its statistics lines without samples)."""
        values = [float(s.running) for s in self.samples]
        if not values:
            values = [
                float(e.fields["running"])
                for e in self.of_kind(EventKind.BATCH_STATS)
                if isinstance(e.fields.get("running"), int)
            ]
        return sum(values) / len(values) if values else None

    @property
    def peak_running(self) -> int | None:
        """The largest running batch of the samples and the statistics lines. A prefill line's batch
        is the one running before it plus the requests it adds: the next decode step runs them all (a
        scrape can miss that step, and a worker that dies in it logs no decode line)."""
        values = [s.running for s in self.samples]
        for e in self.of_kind(EventKind.BATCH_STATS):
            running, added = e.fields.get("running"), e.fields.get("new_seqs")
            if isinstance(running, int):
                values.append(running + (added if isinstance(added, int) else 0))
        return max(values) if values else None

    @property
    def peak_token_usage(self) -> float | None:
        """The largest KV pool usage of the samples (else the statistics lines)."""
        points = self._load_points()
        return max(usage for _, usage, _ in points) if points else None

    @property
    def kv_capacity_tokens(self) -> int | None:
        capacities = [s.max_total_tokens for s in self.samples if s.max_total_tokens]
        return capacities[-1] if capacities else None

    @property
    def mean_request_tokens(self) -> float | None:
        tokens = _counter_increase(
            [
                (s.time, s.finished_request_tokens_total)
                for s in self.samples
                if s.finished_request_tokens_total is not None
            ]
        )
        count = _counter_increase(
            [(s.time, s.finished_requests_total) for s in self.samples if s.finished_requests_total is not None]
        )
        if tokens is None or count is None or count[0] < 1 or tokens[0] <= 0:
            return None
        return tokens[0] / count[0]

    def last(self, kind: EventKind) -> LogEvent | None:
        for event in reversed(self.events):
            if event.kind is kind:
                return event
        return None

    def summary(self) -> dict[str, float | int | None]:
        """The figures a journal entry quotes as before/after."""
        tp = self.throughput
        return {
            "observed_s": round(self.observed_s, 1),
            "throughput": round(tp, 2) if tp is not None else None,
            "retraction_rate_per_min": round(self.retraction_rate_per_min, 3),
            "retractions": self.retractions,
            "peak_running": self.peak_running,
        }
