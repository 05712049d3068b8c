"""The overhead report's rules on figures made here: a round whose path waited for a CPU 10 % of the
time or more is left out of latency but not of the headline; the event-loop probe's stalls, their
kind, and the share of the slowest requests' TTFT they cover."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from pathlib import Path
from typing import Any

import pytest

from loadtests.loadgen import Outcome, RunResult, summarize
from loadtests.loop_lag import LagProbe, Stall, read_window, written_past
from loadtests.overhead import (
    ARMS,
    affinity_by_role,
    aggregate,
    check_pinned,
    cpu_plan,
    summary,
    table,
    tail_stalls,
    usage_window,
)
from tests.harness.wait import wait_until

ROLES = ("client", "worker", "pacer", "sglang-router")


def _latency(arm: str, ttft_ms: float, waited: dict[str, float], cpu_s: float = 0.5) -> dict[str, Any]:
    """One arm's latency round: 100 requests with ``ttft_ms`` each over 10 s, and ``waited`` (fraction of
    the 10 s) per role; the arm's own proxy spent ``cpu_s``."""
    outcomes = [Outcome(i / 10, i / 10, i / 10 + ttft_ms / 1000, i / 10 + 0.05, 2, 16) for i in range(100)]
    s = summarize(RunResult(outcomes, 1.0, 10.0))
    before = dict.fromkeys(ROLES, (0.0, 0.0))
    after = {n: (cpu_s if n == arm else 0.1, waited.get(n, 0.0) * 10) for n in ROLES}
    s.update(usage_window(arm, before, after, 10.0))
    s.update(wall_s=10.0, load_average_1m=1.0, loop_lag={}, tail=None)
    return s


def _stream(arm: str, waited: dict[str, float], chunks_per_cpu_s: float | None) -> dict[str, Any]:
    s: dict[str, Any] = {"chunks_per_s": 1000.0, "stream_tok_per_s": 1000.0, "chunks_per_read": 1.0,
                         "chunks_per_cpu_s": chunks_per_cpu_s, "errors": 0, "load_average_1m": 1.0}  # fmt: skip
    before = dict.fromkeys(ROLES, (0.0, 0.0))
    s.update(usage_window(arm, before, {n: (1.0, waited.get(n, 0.0) * 10) for n in ROLES}, 10.0))
    return s


def test_a_starved_round_is_left_out_of_latency_but_counts_in_the_headline() -> None:
    quiet = {"client": 0.02, "worker": 0.03, "pacer": 0.01, "sglang-router": 0.01}
    starved = {**quiet, "pacer": 0.47}  # the pacer's path only: direct and the router still count
    ttft = {"direct": 2.0, "pacer": 3.0, "sglang-router": 2.5}
    latency = [{arm: _latency(arm, ttft[arm] + rnd, quiet) for arm in ARMS} for rnd in range(2)] + [
        {arm: _latency(arm, ttft[arm] + (800.0 if arm == "pacer" else 0.0), starved, cpu_s=0.8) for arm in ARMS}
    ]
    stream = [
        {arm: _stream(arm, quiet, None if arm == "direct" else 1000.0 * (rnd + 1)) for arm in ARMS} for rnd in range(3)
    ]
    report = aggregate(latency, stream)

    third = latency[2]["pacer"]
    assert third["waited_most"] == ["pacer", 0.47] and third["counted"] is False
    assert latency[2]["direct"]["counted"] and latency[2]["sglang-router"]["counted"]
    assert report["pacer_latency_rounds_counted"] == 2 and report["router_latency_rounds_counted"] == 3
    assert report["pacer_added_ttft_p50_ms"] == pytest.approx(1.0)  # the 800 ms round is not in it
    assert report["pacer"]["ttft_p99_ms"] == pytest.approx(3.5)
    assert report["router_added_ttft_p50_ms"] == pytest.approx(0.5)
    # the headline keeps every round: 50, 50 and 80 ms of CPU over 100 requests each
    assert report["pacer_cpu_ms_per_request"] == pytest.approx(5.0)
    assert report["pacer_chunks_per_cpu_s"] == pytest.approx(2000.0)
    assert report["pacer_per_router_chunks_per_cpu_s"] == pytest.approx(1.0)

    printed = "\n".join(summary(report))
    assert "2 of 3 rounds; most waited per round: 3.0 %, 3.0 %, 47 % starved (pacer)" in printed
    assert "| pacer | 2 of 3 |" in table(report)


def test_no_round_under_the_limit_means_no_latency_figure() -> None:
    starved = dict.fromkeys(ROLES, 0.3)
    latency = [{arm: _latency(arm, 2.0, starved) for arm in ARMS}]
    stream = [{arm: _stream(arm, starved, None if arm == "direct" else 900.0) for arm in ARMS}]
    report = aggregate(latency, stream)
    assert report["pacer_added_ttft_p50_ms"] is None and report["pacer_throughput_ratio"] is None
    assert report["pacer"]["ttft_p50_ms"] is None and report["pacer"]["chunks_per_s"] is None
    assert report["pacer_chunks_per_cpu_s"] == 900.0 and report["pacer_cpu_ms_per_request"] == pytest.approx(5.0)
    assert "  pacer          no round timed (0 of 1 rounds; most waited per round: 30 % starved (client))" in "\n".join(
        summary(report)
    )


def test_the_proxy_gets_a_cpu_of_its_own_planned_from_the_cpus_before_the_client_pins_itself() -> None:
    pins = cpu_plan(True, frozenset({0, 1, 2}))
    assert pins == {"middle": {2}, "worker": {0, 1}, "client": {0, 1}}
    # planned again from the pinned client's CPUs there is nothing to split: everything would share them
    assert cpu_plan(True, pins["client"] - {1}) == {} and cpu_plan(False, frozenset({0, 1})) == {}
    check_pinned({"worker": {0, 1}, "pacer": {2}, "sglang-router": {2}}, pins)
    with pytest.raises(RuntimeError, match=re.escape("not on their planned CPUs: {'pacer': [0]}")):
        check_pinned({"worker": {0}, "pacer": {0}, "sglang-router": {2}}, cpu_plan(True, frozenset({0, 2})))
    started = [{"role": "worker", "cpus": [0, 1]}, {"role": "pacer", "cpus": [2]}, {"role": "pacer", "cpus": [1]}]
    assert affinity_by_role(started, [0, 1]) == {"client": [0, 1], "worker": [0, 1], "pacer": [1, 2]}


def test_a_stall_is_named_after_what_held_the_loop() -> None:
    assert Stall(0.0, 0.1, ran_ms=10, waited_ms=60, gc_ms=0).kind == "starved"
    assert Stall(0.0, 0.1, ran_ms=100, waited_ms=0, gc_ms=70).kind == "gc"
    assert Stall(0.0, 0.1, ran_ms=100, waited_ms=10, gc_ms=0).kind == "busy"
    assert Stall(0.0, 0.1, ran_ms=5, waited_ms=5, gc_ms=0).kind == "blocked"


def test_the_slowest_requests_are_matched_with_the_stalls_they_waited_through() -> None:
    fast = [Outcome(i, i, i + 0.001 + i * 1e-6, i + 0.003) for i in range(99)]  # TTFT 1.000 to 1.098 ms
    outcomes = [*fast, Outcome(200.0, 200.0, 200.5, 200.6)]
    stalls = {"pacer": [Stall(200.1, 200.4, 10, 250, 0)], "worker": [Stall(50.0, 50.3, 300, 0, 0)]}
    tail = tail_stalls(outcomes, stalls)
    assert tail is not None and tail["requests"] == 2  # at or over the p99: the last fast one, the slow one
    assert tail["ttft_s"] == pytest.approx(0.5 + 0.001098, abs=1e-4)
    assert tail["stalled_s"]["pacer"]["starved"] == pytest.approx(0.3)
    assert sum(tail["stalled_s"]["worker"].values()) == 0  # its stall was long before


async def test_the_probe_sees_a_blocking_call_on_its_loop(tmp_path: Path) -> None:
    out = tmp_path / "lag.jsonl"
    probe = LagProbe(out)
    probe.start()
    seen = asyncio.Event()

    def block() -> None:
        time.sleep(0.3)  # what is measured: a call that holds the loop without using a CPU
        loop.call_later(0.1, collect)

    def collect() -> None:
        gc.collect()  # and, apart from it, one full pass of the collector
        seen.set()

    t0 = time.perf_counter()
    for _ in range(3):
        await asyncio.sleep(0)  # the probe's first wake-up is due
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, block)
    await seen.wait()
    await wait_until(  # the probe writes its line a moment later
        lambda: (w := read_window(out, t0, time.perf_counter())) is not None and w.stalls, "the stall written"
    )
    await probe.stop()
    window = read_window(out, t0, time.perf_counter())
    assert window is not None and window.lags_ms
    blocked = [s for s in window.stalls if s.kind == "blocked" and 250 <= s.lag_ms < 2000]
    assert len(blocked) == 1, window.stalls
    (full,) = window.full_passes  # [start, wall ms, CPU ms, objects freed]
    assert full[0] > blocked[0].end and full[1] > 0 and full[2] >= 0
    assert read_window(out, t0 - 100, t0 - 50) is None  # nothing before it started


def test_a_window_is_read_once_the_probe_wrote_a_line_whose_middle_lies_past_it(tmp_path: Path) -> None:
    out = tmp_path / "lag.jsonl"
    assert not written_past(out, 10.0)  # no probe yet
    line = '{"t0":%s,"t1":%s,"lags_ms":[],"stalls":[],"ran_s":0,"waited_s":0,"gc_s":0,"gc_full_passes":[]}\n'
    out.write_text(line % (9.75, 10.0))
    assert not written_past(out, 10.0)
    with out.open("a") as f:
        f.write(line % (10.0, 10.25))  # its middle, 10.125, is read by a window up to 10.1 but not 10.2
        f.write('{"t0":10.25,"t1"')  # a line being written
    assert written_past(out, 10.1) and not written_past(out, 10.2)
