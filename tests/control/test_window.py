"""The window's bookkeeping and derived figures, on hand-built and recorded sequences."""

from __future__ import annotations

import pytest

from proxy.control.window import Window
from proxy.engines.base import EventKind, LogEvent, Sample

from .recorded import log_events, samples, window_of


def s(t: float, **kw: object) -> Sample:
    base: dict[str, object] = {"queue": 0, "running": 0, "token_usage": 0.0}
    return Sample(time=t, **{**base, **kw})  # type: ignore[arg-type]


def test_push_is_pure_and_prunes_by_span() -> None:
    w0 = Window(span_s=10.0)
    w1 = w0.push(s(0.0))
    assert w0.samples == () and len(w1.samples) == 1
    w2 = w1.push_all([s(t) for t in (5.0, 9.0, 12.0)])
    assert [x.time for x in w2.samples] == [5.0, 9.0, 12.0]  # 0.0 fell out of the last 10 s
    assert [x.time for x in w2.at(20.0).samples] == [12.0]
    assert w2.observed_s == 7.0 and w2.at(30.0).observed_s == 0.0


def test_items_before_since_are_ignored() -> None:
    w = Window(span_s=60.0, since=100.0).push(s(99.0)).push(s(101.0))
    assert [x.time for x in w.samples] == [101.0]


def test_the_evidence_after_a_moment() -> None:
    w = Window(span_s=60.0).push_all([s(t) for t in (0.0, 4.0, 8.0, 12.0)])
    later = w.after(5.0)
    assert [x.time for x in later.samples] == [8.0, 12.0] and later.observed_s == 4.0 and w.observed_s == 12.0
    assert later.push(s(4.5)).samples == later.samples  # before its start: ignored, as before since
    assert w.after(float("-inf")) is w


def test_retraction_counter_with_reset() -> None:
    w = Window(span_s=100.0).push_all(
        [
            s(0, retractions_total=0.0),
            s(10, retractions_total=5.0),
            s(20, retractions_total=10.0),
            s(30, retractions_total=2.0),
            s(40, retractions_total=4.0),
        ]
    )
    assert w.retractions == 14  # 5 + 5 + (reset) 2 + 2
    assert w.retraction_rate_per_min == pytest.approx(14 / 40 * 60)


def test_retraction_rate_from_log_lines_when_no_counter() -> None:
    w = window_of(log_events("log_retraction_storm.log"))
    assert w.retractions == 9
    assert w.retraction_rate_per_min == pytest.approx(9 / 34 * 60)
    assert w.peak_running == 222 and w.throughput == pytest.approx(16784.91 / 7)


def test_forced_retractions_do_not_count() -> None:
    e = LogEvent(kind=EventKind.RETRACTION, time=1.0, fields={"retracted": 4, "forced": True})
    w = Window().push(s(0.0)).push(e)
    assert w.retractions == 0 and w.retraction_rate_per_min == 0.0


def test_conservative_fraction_and_cap() -> None:
    w = window_of(samples("samples_conservative.json"))
    assert w.conservative_fraction(0.9) == 1.0
    assert w.conservative_fraction(0.5) == 0.0
    capped = window_of(samples("samples_capped.json"))
    assert capped.at_cap_fraction(64) == 1.0 and capped.at_cap_fraction(256) == 0.0
    assert capped.at_cap_fraction(None) == 0.0


def test_throughput_prefers_the_token_counter() -> None:
    w = Window().push_all(
        [
            s(0, generation_tokens_total=0.0, gen_throughput=1.0),
            s(10, generation_tokens_total=5000.0, gen_throughput=1.0),
        ]
    )
    assert w.throughput == 500.0
    assert Window().push_all([s(0, gen_throughput=10.0), s(1, gen_throughput=30.0)]).throughput == 20.0
    assert Window().throughput is None


def test_timid_fraction_needs_proxy_backlog() -> None:
    w = Window().push_proxy_queue(0.0, 50)
    w = w.push_all([s(1.0, queue=0), s(2.0, queue=0), s(3.0, queue=40), s(4.0, queue=0)])
    assert w.timid_fraction() == 0.75
    assert Window().push_all([s(1.0, queue=0)]).timid_fraction() == 0.0  # the proxy held nothing
    # batch work its class's gates hold beside interactive work waits by design: only the rest counts
    looks = [s(1.0, queue=0), s(2.0, queue=0), s(3.0, queue=40), s(4.0, queue=0)]
    assert Window().push_proxy_queue(0.0, 50, 50).push_all(looks).timid_fraction() == 0.0
    assert Window().push_proxy_queue(0.0, 50, 49).push_all(looks).timid_fraction() == 0.75
    assert Window().push_proxy_queue(0.0, 50, 80).proxy_queue == ((0.0, 50, 50),)  # never more than it holds


def test_restart_and_begin_keep_the_new_startup_line() -> None:
    old = window_of(log_events("log_startup_headroom.log"), samples("samples_idle.json"))
    assert old.startup is not None
    restarting = old.restart(100.0)
    assert restarting.startup is None and restarting.samples == () and restarting.events == ()
    startup = LogEvent(kind=EventKind.STARTUP, time=105.0, fields={"available_gpu_mem_gb": 7.0})
    serving = restarting.push(startup).push(s(106.0)).begin(110.0)
    assert serving.startup is startup and serving.samples == () and serving.since == 110.0


def test_a_prefill_line_s_batch_counts_the_requests_it_adds() -> None:
    # a worker that dies in the decode step after this prefill logs no decode line with 150 running
    prefill = LogEvent(kind=EventKind.BATCH_STATS, time=1.0, fields={"running": 20, "new_seqs": 130, "queue": 9})
    decode = LogEvent(kind=EventKind.BATCH_STATS, time=0.5, fields={"running": 40, "queue": 9})
    w = Window().push(s(0.0, running=1)).push(decode).push(prefill)
    assert w.peak_running == 150
