"""The dashboard's history: points from the board's samples, rates from counter differences, a
counter that drops (a restart) starts again, the ring keeps only the newest points."""

from __future__ import annotations

import asyncio

import pytest

from proxy.dashboard.history import History
from proxy.engines.base import Sample


class Clocks:
    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = 1_700_000_000.0

    def tick(self, dt: float) -> None:
        self.mono += dt
        self.wall += dt


def make(clocks: Clocks, keep: int = 100) -> History:
    return History(
        lambda: ({"interactive": 3, "batch": 7}, 5),
        lambda worker_id: 2,
        keep=keep,
        wall_clock=lambda: clocks.wall,
        monotonic=lambda: clocks.mono,
    )


def sample(clocks: Clocks, retracted: float, generated: float, **kw: float) -> Sample:
    return Sample(time=clocks.mono, queue=4, running=8, token_usage=0.5, retractions_total=retracted,
                  generation_tokens_total=generated, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_rates_from_counters_and_a_restart() -> None:
    clocks = Clocks()
    h = make(clocks)
    h.on_sample("w0", sample(clocks, 10, 1000), None)
    clocks.tick(2.0)
    h.on_sample("w0", sample(clocks, 14, 3000), None)  # 4 retractions in 2 s, 2000 tokens in 2 s
    clocks.tick(2.0)
    h.on_sample("w0", sample(clocks, 1, 500), None)  # restarted: counters began again
    h.on_sample("w0", None, "connection refused")  # a failed scrape adds no point
    s = h.worker_series("w0", since=0.0)
    assert s["t"] == [1_700_000_000.0, 1_700_000_002.0, 1_700_000_004.0]
    assert s["retractions_per_min"] == [None, 120.0, 30.0]
    assert s["gen_throughput"] == [None, 1000.0, None]  # across the restart the rate is not known
    assert s["queue"] == [4, 4, 4] and s["running"] == [8, 8, 8] and s["in_flight"] == [2, 2, 2]
    assert h.worker_series("w0", since=1_700_000_003.0)["t"] == [1_700_000_004.0]
    assert h.worker_series("w9", since=0.0)["t"] == []


def test_engine_throughput_gauge_wins_and_sample_time_is_kept() -> None:
    clocks = Clocks()
    h = make(clocks)
    s = Sample(time=clocks.mono - 0.5, queue=0, running=1, token_usage=0.1, gen_throughput=42.0)
    h.on_sample("w0", s, None)
    series = h.worker_series("w0", since=0.0)
    assert series["gen_throughput"] == [42.0]
    assert series["t"] == [clocks.wall - 0.5]  # when it was scraped, on the wall clock
    clocks.tick(1.0)
    idle = Sample(time=clocks.mono, queue=0, running=0, token_usage=0.0, gen_throughput=42.0)
    h.on_sample("w0", idle, None)  # SGLang's gauge keeps its last decode batch's figure once idle
    assert h.worker_series("w0", since=0.0)["gen_throughput"] == [42.0, 0.0]


def test_proxy_queue_per_class_at_most_every_step_and_rings_are_bounded() -> None:
    clocks = Clocks()
    h = make(clocks, keep=3)
    for _ in range(10):
        h.on_sample("w0", sample(clocks, 0, 0), None)
        h.on_sample("w1", sample(clocks, 0, 0), None)  # the same instant: one proxy point
        clocks.tick(1.0)
    assert len(h.worker_series("w0", since=0.0)["t"]) == 3
    p = h.proxy_series(since=0.0)
    assert len(p["t"]) == 3 and p["queue_interactive"] == [3, 3, 3] and p["queue_batch"] == [7, 7, 7]
    assert p["in_flight"] == [5, 5, 5]


@pytest.mark.looptime
async def test_the_proxy_queue_is_recorded_while_no_worker_is_scraped() -> None:
    """The only worker down or starting: no sample comes, but the queue fills then, and the chart must
    show it (it showed the last value before the outage, then nothing)."""
    clocks, queued = Clocks(), {"interactive": 0}
    h = History(lambda: (dict(queued), 0), lambda worker_id: 0, wall_clock=lambda: clocks.wall,
                monotonic=lambda: clocks.mono)  # fmt: skip
    for depth in (0, 120, 300):
        queued["interactive"] = depth
        h.proxy_point()
        h.proxy_point()  # at most one a min_proxy_step_s
        clocks.tick(1.0)
    series = h.proxy_series(since=0.0)
    assert series["queue_interactive"] == [0, 120, 300] and h.worker_ids() == []
    runner = asyncio.create_task(h.run(0.01))  # the clock of its own the proxy runs it on
    await asyncio.sleep(0.05)  # five of its rounds (virtual time)
    runner.cancel()
    assert len(h.proxy_series(since=0.0)["t"]) == 4  # the wall clock stood still: one more point
