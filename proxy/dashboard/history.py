"""The dashboard's memory: a bounded ring of recent points per worker and for the proxy's queue.

It scrapes nothing. It is one more observer of the :class:`~proxy.request.pacing.LoadBoard`
(``board.subscribe(history.on_sample)``), so it sees exactly the samples the dispatcher and the
controller see; at each sample it also reads the proxy's own queue depth per class through the
``proxy_queue`` callable. Each ring keeps the newest ``keep`` points (at a 0.5 s scrape, 3600 points
are half an hour); older ones fall off.

Times are wall-clock epoch seconds (a sample's monotonic time shifted by the wall clock's offset),
so the browser can put them on a date axis next to the journal's ISO times.

Derived per point: the retraction rate per minute and, where the engine has no throughput gauge,
the generation throughput, both from the counters' differences (a drop is a restart: the counter
starts again at its new value, which counts as the difference).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.engines.base import Sample, output_rate

__all__ = ["History", "ProxyPoint", "WorkerPoint"]

# the series each worker point carries, in the order the JSON lists them
WORKER_FIELDS = ("queue", "running", "token_usage", "gen_throughput", "retractions_per_min", "in_flight")


@dataclass(frozen=True, slots=True)
class WorkerPoint:
    t: float  # epoch seconds
    queue: int
    running: int
    token_usage: float
    gen_throughput: float | None
    retractions_per_min: float | None
    in_flight: int


@dataclass(frozen=True, slots=True)
class ProxyPoint:
    t: float
    queue: Mapping[str, int]  # per priority class
    in_flight: int


def _delta(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    return new - old if new >= old else new  # a drop: the worker restarted, its counter began again


class History:
    """Recent points per worker (``on_sample``, a board observer) and of the proxy's queue."""

    def __init__(
        self,
        proxy_queue: Callable[[], tuple[Mapping[str, int], int]],
        in_flight: Callable[[str], int],
        *,
        keep: int = 3600,
        min_proxy_step_s: float = 0.2,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proxy_queue = proxy_queue
        self._in_flight = in_flight
        self._keep = keep
        self._min_proxy_step_s = min_proxy_step_s
        self._wall = wall_clock
        self._mono = monotonic
        self._workers: dict[str, deque[WorkerPoint]] = {}
        self._last_sample: dict[str, Sample] = {}
        self._proxy: deque[ProxyPoint] = deque(maxlen=keep)

    def on_sample(self, worker_id: str, sample: Sample | None, error: str | None) -> None:
        """A board observer: one point per scraped sample (a failed scrape adds none)."""
        now_wall = self._wall()
        if sample is not None:
            t = now_wall - max(0.0, self._mono() - sample.time)
            prev = self._last_sample.get(worker_id)
            retractions = None
            if prev is not None and sample.time > prev.time:
                dt = sample.time - prev.time
                d_retracted = _delta(sample.retractions_total, prev.retractions_total)
                retractions = None if d_retracted is None else d_retracted / dt * 60.0
            throughput = output_rate(prev, sample)
            self._last_sample[worker_id] = sample
            ring = self._workers.get(worker_id)
            if ring is None:
                ring = self._workers[worker_id] = deque(maxlen=self._keep)
            ring.append(
                WorkerPoint(
                    t=round(t, 3),
                    queue=sample.queue,
                    running=sample.running,
                    token_usage=sample.token_usage,
                    gen_throughput=throughput,
                    retractions_per_min=retractions,
                    in_flight=self._in_flight(worker_id),
                )
            )
        self.proxy_point()

    def proxy_point(self) -> None:
        """One point of the proxy's queue and in flight (at most one per ``min_proxy_step_s``)."""
        now_wall = self._wall()
        if not self._proxy or now_wall - self._proxy[-1].t >= self._min_proxy_step_s:
            queue, in_flight = self._proxy_queue()
            self._proxy.append(ProxyPoint(t=round(now_wall, 3), queue=dict(queue), in_flight=in_flight))

    async def run(self, interval_s: float) -> None:
        """The proxy's points on a clock of their own, until cancelled: the samples add one as they
        come, but while no worker is ready none come, and a queue filling then is what matters."""
        while True:
            self.proxy_point()
            await asyncio.sleep(interval_s)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def worker_series(self, worker_id: str, since: float) -> dict[str, list[float | int | None]]:
        """Columns (``t`` first) of the points newer than ``since``."""
        points = [p for p in self._workers.get(worker_id, ()) if p.t > since]
        out: dict[str, list[float | int | None]] = {"t": [p.t for p in points]}
        for name in WORKER_FIELDS:
            out[name] = [getattr(p, name) for p in points]
        return out

    def proxy_series(self, since: float) -> dict[str, list[float | int | None]]:
        points = [p for p in self._proxy if p.t > since]
        classes = sorted({c for p in points for c in p.queue})
        out: dict[str, list[float | int | None]] = {"t": [p.t for p in points]}
        for c in classes:
            out[f"queue_{c}"] = [p.queue.get(c, 0) for p in points]
        out["in_flight"] = [p.in_flight for p in points]
        return out

    def now(self) -> float:
        return self._wall()
