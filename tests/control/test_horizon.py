"""The planner's horizon from the traffic itself: the backlog folded over the looks at a worker, its
expected remainder between the configured horizon and the longest allowed, and two recorded hours
(the premises' runs with arrivals over time) it must tell apart."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from proxy.control.horizon import Backlog, answer_rate, expected_horizon
from proxy.control.planner import Observed
from proxy.engines.base import Sample
from proxy.policy import ControlMode
from proxy.workers.base import WorkerState

from .test_controller import Around, controller, info

FIXTURES = Path(__file__).parent / "fixtures"


def _fold(looks: list[tuple[float, float]]) -> Backlog:
    backlog = Backlog()
    for time, waiting in looks:
        backlog = backlog.observe(time, waiting)
    return backlog


def test_a_look_with_nothing_waiting_in_a_full_pool_does_not_end_the_backlog() -> None:
    """The worker admitted its whole queue into a full KV pool: it has not caught up (what it
    retracts, or what arrives next, waits again). Nothing waiting with room in the pool ends it."""
    b = Backlog().observe(0.0, 40).observe(10.0, 50)
    kept = b.observe(20.0, 0, full=True)
    assert kept.since == 0.0 and kept.waiting == 0 and kept.looks == 3
    assert kept.observe(30.0, 60).age(30.0) == 30.0
    assert b.observe(20.0, 0, full=False) == Backlog()
    assert Backlog().observe(0.0, 0, full=True) == Backlog()  # a full pool with nothing waiting begins nothing


def test_a_backlog_begins_with_work_waiting_and_one_look_without_any_ends_it() -> None:
    b = _fold([(0.0, 0), (10.0, 3), (20.0, 5), (30.0, 7)])
    assert b.since == 10.0 and b.age(40.0) == 30.0 and b.waiting == 7 and b.looks == 3
    assert b.flow is not None and b.flow.slope == pytest.approx(0.2)  # 3, 5, 7 requests 10 s apart: +0.2 a second
    ended = b.observe(40.0, 0)
    assert ended == Backlog() and ended.since is None and ended.age(50.0) == 0.0
    again = ended.observe(50.0, 4)
    assert again.since == 50.0 and again.flow is None  # a new backlog: one look, no trend yet


def test_answer_rate_is_the_newest_answers_over_the_time_they_ended_in() -> None:
    answered = [Observed(arrived=0.0, prompt_tokens=1, output_tokens=1, max_tokens=1, finished=float(t))
                for t in range(0, 100, 2)]  # fmt: skip  # one answer every 2 s
    open_ = Observed(arrived=0.0, prompt_tokens=1, output_tokens=1, max_tokens=1)  # not answered: not counted
    assert answer_rate([*answered, open_], newest=300) == pytest.approx(0.5)
    assert answer_rate(answered[-11:] + answered[:5], newest=11) == pytest.approx(0.5)  # the newest 11 only
    assert answer_rate(answered[:1], newest=300) is None


def test_no_backlog_keeps_the_configured_horizon() -> None:
    h = expected_horizon(Backlog(), 100.0, 1.0, configured_s=600.0, longest_s=3600.0)
    assert (h.seconds, h.basis, h.backlog_s, h.waiting) == (600.0, "configured", 0.0, 0.0)
    assert "no work waiting" in h.describe()


def test_a_backlog_that_lasted_is_expected_to_last_its_expected_remainder_and_then_drain() -> None:
    looks = [(float(t), 100 + t / 100) for t in range(0, 1201, 10)]  # growing slowly for 20 minutes
    h = expected_horizon(_fold(looks), 1200.0, 0.5, configured_s=600.0, longest_s=3600.0)
    assert h.basis == "traffic" and h.drain_s == pytest.approx(112 / 0.5)
    # lasting x more with odds A / (A + x): E[min(remainder, 3600)] = 1200 ln(1 + 3600 / 1200), then the drain
    expected = 1200 * math.log(4.0) + 224
    assert h.seconds == pytest.approx(expected, abs=0.1) and h.expected_s == pytest.approx(expected)
    assert "work waiting for 1200 s" in h.describe() and "224 s to drain" in h.describe()
    e = h.evidence().to_json()
    assert e["horizon_basis"] == "traffic" and e["backlog_s"] == 1200.0 and e["drain_s"] == 224.0
    assert e["backlog_trend"] == pytest.approx(0.01)


def test_a_passing_backlog_keeps_the_floor_and_a_long_one_stops_at_the_longest() -> None:
    young = expected_horizon(_fold([(0.0, 20), (60.0, 30)]), 60.0, 1.0, configured_s=600.0, longest_s=3600.0)
    assert young.seconds == 600.0 and young.basis == "configured"
    assert young.expected_s == pytest.approx(60 * math.log(61.0) + 30.0)
    old = _fold([(float(t), 50) for t in range(0, 5001, 100)])
    aged = expected_horizon(old, 5000.0, 1.0, configured_s=600.0, longest_s=3600.0)
    assert aged.seconds == pytest.approx(5000 * math.log(1.72) + 50, abs=0.1) and aged.basis == "traffic"
    deep = _fold([(float(t), 5000) for t in range(0, 5001, 100)])  # its drain alone outlasts the longest
    capped = expected_horizon(deep, 5000.0, 1.0, configured_s=600.0, longest_s=3600.0)
    assert capped.seconds == 3600.0 and capped.basis == "longest"
    fixed = expected_horizon(old, 5000.0, 1.0, configured_s=600.0, longest_s=600.0)  # longest at the floor: fixed
    assert fixed.seconds == 600.0 and fixed.basis == "configured"


def test_a_shrinking_backlog_is_over_when_its_waiting_is_gone_at_that_pace() -> None:
    # a batch submitted at once, answered one a second: 1000 waiting, then 900, ... its remainder is
    # the waiting at the pace it falls, not as long again as it lasted
    looks = [(float(t), 1000.0 - t) for t in range(0, 501, 10)]
    h = expected_horizon(_fold(looks), 500.0, 1.0, configured_s=60.0, longest_s=3600.0)
    assert h.flow is not None and h.flow.slope == pytest.approx(-1.0)
    assert h.seconds == pytest.approx(500.0) and h.basis == "traffic"
    # shrinking slowly: no longer than a backlog holding, no shorter than its drain
    slow = [(float(t), 1000.0 - t / 100) for t in range(0, 501, 10)]
    hs = expected_horizon(_fold(slow), 500.0, 10.0, configured_s=60.0, longest_s=3600.0)
    assert hs.seconds == pytest.approx(500.0 * math.log(8.2) + 99.5, abs=0.1)  # as if holding (995 at 10 a second)
    fast = expected_horizon(_fold(looks), 500.0, 0.1, configured_s=60.0, longest_s=100_000.0)
    assert fast.seconds == pytest.approx(5000.0)  # the drain at the answer rate, the least it can last


def test_the_trend_is_the_work_held_not_the_waiting_and_only_the_last_looks() -> None:
    """A retraction storm moves requests between the running batch and the queue: the waiting swings
    while the work held (waiting + running) holds, and the trend is that of the work held. A backlog
    built by one phase and drained by the next reads as falling once the build-up is out of memory."""
    swinging = Backlog()
    for k in range(30):  # 120 held every look: 60 waiting and 60 running, then 100 and 20 (retracted), ...
        waiting = 60.0 if k % 4 < 2 else 100.0
        swinging = swinging.observe(10.0 * k, waiting, running=120.0 - waiting)
    assert swinging.flow is not None and swinging.flow.slope == pytest.approx(0.0, abs=1e-9)
    assert swinging.flow.falling_at_least is None
    built_then_drained = Backlog(memory_s=100.0)
    for t in range(0, 601, 10):  # held grows 1 a second for 300 s, then falls 0.5 a second
        held = float(t) if t <= 300 else 300.0 - 0.5 * (t - 300)
        built_then_drained = built_then_drained.observe(float(t), held / 2, running=held / 2)
    flow = built_then_drained.flow
    assert flow is not None and flow.looks == 11 and flow.slope == pytest.approx(-0.5)  # the last 100 s only
    h = expected_horizon(built_then_drained, 600.0, 1.0, configured_s=10.0, longest_s=3600.0)
    assert h.waiting == 75.0 and h.seconds == pytest.approx(150.0)  # its waiting at 0.5 a second (drain: 75 s)
    whole = Backlog(memory_s=1000.0)  # a memory over the whole backlog: the build-up outweighs the drain
    for t in range(0, 601, 10):
        held = float(t) if t <= 300 else 300.0 - 0.5 * (t - 300)
        whole = whole.observe(float(t), held / 2, running=held / 2)
    assert whole.flow is not None and whole.flow.falling_at_least is None


def test_a_worker_joining_or_leaving_the_pool_reads_the_flow_afresh() -> None:
    """Four workers share 400 requests in the proxy's queue (100 each, 50 running); one restarts and
    three share them (133 each), then it is back. Nothing arrived or was answered: the steps are the
    share's. Read across the pool's sizes, the step back down is a fall for sure."""
    looks = [(4, 100.0)] * 20 + [(3, 400.0 / 3)] * 20 + [(4, 100.0)] * 5
    afresh, across = Backlog(), Backlog()
    for k, (sharing, waiting) in enumerate(looks):
        afresh = afresh.observe(10.0 * k, waiting, running=50.0, sharing=sharing)
        across = across.observe(10.0 * k, waiting, running=50.0)
    assert afresh.flow is not None and afresh.flow.looks == 5 and afresh.flow.slope == pytest.approx(0.0, abs=1e-9)
    assert across.flow is not None and across.flow.falling_at_least is not None


def test_a_fall_inside_the_arrivals_noise_is_not_believed() -> None:
    """Held work scattered about a slight fall: the fitted slope is negative, but two standard errors
    up it is not; the horizon is that of a backlog holding. The same fall without the scatter is."""
    noisy, clean = Backlog(), Backlog()
    for k in range(25):
        t = 10.0 * k
        noisy = noisy.observe(t, 400.0 - 0.5 * t + (100.0 if k % 2 else -100.0))
        clean = clean.observe(t, 400.0 - 0.5 * t)
    assert noisy.flow is not None and noisy.flow.slope < 0 and noisy.flow.falling_at_least is None
    assert clean.flow is not None and clean.flow.falling_at_least == pytest.approx(0.5)
    held = expected_horizon(noisy, 240.0, 1.0, configured_s=60.0, longest_s=3600.0)
    assert held.waiting == 180.0 and held.expected_s == pytest.approx(240.0 * math.log(16.0) + 180.0)
    falling = expected_horizon(clean, 240.0, 1.0, configured_s=60.0, longest_s=3600.0)
    assert falling.waiting == 280.0 and falling.expected_s == pytest.approx(280.0 / 0.5)  # not 945 s holding
    e = falling.evidence().to_json()
    assert e["backlog_trend"] == pytest.approx(-0.5) and e["backlog_falling"] == pytest.approx(0.5)
    assert "falling at least 0.500/s" in falling.describe()


def _recorded(name: str) -> list[list[float]]:
    rows: list[list[float]] = json.loads((FIXTURES / "waiting_premises.json").read_text())[name]
    return rows


def _horizons(name: str, memory_s: float = 240.0) -> list[tuple[float, float]]:
    """(modelled s, horizon) at every minute of a recorded hour, the answer rate over the last minute."""
    rows = _recorded(name)
    backlog, out, next_plan = Backlog(memory_s=memory_s), [], 60.0
    for i, (t, waiting, _, usage, running) in enumerate(rows):
        backlog = backlog.observe(t, waiting, running=running, full=usage is not None and usage >= 0.9)
        if t >= next_plan:
            earlier = [r for r in rows[: i + 1] if r[0] >= t - 60.0]
            answered, span = rows[i][2] - earlier[0][2], t - earlier[0][0]
            rate = answered / span if span > 0 and answered > 0 else None
            out.append((t, expected_horizon(backlog, t, rate, configured_s=600.0, longest_s=3600.0).seconds))
            next_plan += 60.0
    return out


def test_recorded_hours_a_backlog_that_lasts_earns_a_longer_horizon_and_waiting_that_comes_and_goes_does_not() -> None:
    """retraction-storm-poisson (1.2 arrivals a second against ~1.06 served: work waits in the server's
    queue from 229 modelled s to the end, swinging with the retractions) against early-stop-poisson (the
    worker keeps up: its queue fills for a few minutes at most, then empties, with room in the KV pool).
    The storm's horizon leaves the configured 600 s once its backlog's expected remainder outlasts it and
    grows with it, and comes back when the backlog is gone; early-stop's never leaves it. Two storm
    hours: the work held swings with the retractions and the arrivals are noisy; two of the second
    hour's sixty looks read a fall for sure (842 s: held 200 -> 178 in a minute, 33 waiting: 788 s,
    not 1,201 s; 962 s: 1,180 s, not 1,361 s), and stay above the configured horizon."""
    early = _horizons("early-stop-poisson")
    assert all(h == 600.0 for t, h in early if t < 3600.0)
    for name in ("retraction-storm-poisson", "retraction-storm-poisson-2"):
        storm = _horizons(name)
        assert all(h == 600.0 for t, h in storm if t < 400.0)  # the backlog begins at 229 s
        assert min(h for t, h in storm if 560.0 <= t <= 3600.0) > 780.0  # its expected remainder beats its age
        later = [(t, h) for t, h in storm if 1200.0 <= t <= 2000.0]
        assert later and all(h > t - 229.0 for t, h in later)  # more than its age while the longest is far
        assert min(h for t, h in storm if 2400.0 <= t <= 3600.0) > max(h for t, h in later if t <= 1500.0)
        assert max(h for t, h in storm if t > 540.0) < 3600.0  # an expectation never reaches the longest allowed
        assert storm[-1][1] == 600.0  # the hour's arrivals answered, nothing waits: the configured horizon
        whole = dict(_horizons(name, memory_s=1e9))
        read_falling = [t for t, h in storm if t <= 3600.0 and h < whole[t] - 1.0]
        assert len(read_falling) == {"retraction-storm-poisson": 0, "retraction-storm-poisson-2": 2}[name]


def test_recorded_shift_the_batch_phase_drains_the_backlog_the_chat_phase_built() -> None:
    """shift-perturbed: the chat phase's arrivals outrun the worker from 15 modelled s, the batch arrives
    on top (487 waiting at 361 s) and from about 420 s the work held falls ~0.9 requests a second. Read
    over the last 240 s the backlog is draining: the configured horizon (the run, over the whole backlog,
    restarted at 650 s on 1,428 s of horizon and lost 4 % of the batch phase). Read over the whole
    backlog, the build-up outweighs the fall."""
    recent = dict(_horizons("shift-perturbed"))
    whole = dict(_horizons("shift-perturbed", memory_s=1e9))
    draining = [t for t in recent if 470.0 <= t <= 700.0]
    assert len(draining) == 4 and all(recent[t] == 600.0 for t in draining)
    assert all(whole[t] > 1300.0 for t in draining)
    assert min(h for t, h in recent.items() if 300.0 <= t <= 430.0) > 900.0  # piling up: a longer horizon


def test_recorded_a_look_with_nothing_waiting_in_a_full_pool_keeps_the_backlog() -> None:
    """An earlier storm hour's one look with nothing waiting (998.8 s) found the pool full (0.95): the
    worker had admitted its whole queue, and the backlog that began at 229 s goes on."""
    backlog = Backlog()
    for t, waiting, _, usage in _recorded("retraction-storm-poisson-full-look"):
        backlog = backlog.observe(t, waiting, full=usage is not None and usage >= 0.9)
        if 998.0 <= t <= 1100.0:
            assert backlog.since is not None and backlog.since < 300.0
    no_full_rule = Backlog()
    for t, waiting, _, _ in _recorded("retraction-storm-poisson-full-look"):
        no_full_rule = no_full_rule.observe(t, waiting)
        if 998.0 <= t <= 1100.0:
            assert no_full_rule.since is None or no_full_rule.since > 998.0


def test_the_controller_counts_the_servers_queue_and_its_share_of_the_proxys_and_a_restart_keeps_the_backlog() -> None:
    """Two workers serving one pool, 100 requests held by the proxy: each look at a worker counts its
    own server queue and half the proxy's. The worker's restart (its window emptied) keeps the
    backlog: the traffic is the same, the requests taken back wait in the proxy."""
    c, clock = controller(ControlMode.AUTO, None, around=Around(backlog=100))
    c.track(info("w0"))
    c.track(info("w1"))
    for k in range(10):
        clock.now = float(k)
        c.on_sample("w0", Sample(time=clock.now, queue=7, running=50, token_usage=0.5))
    assert c.backlog("w0").waiting == 7 + 50 and c.backlog("w0").age(9.0) == 9.0
    assert c.backlog("w0").held[-1] == (9.0, 7 + 50 + 50)  # its trend reads the work held: waiting and running
    assert c.backlog("w0").memory_s == c.constants.plan_trend_s
    assert c.backlog("w1").since is None  # not looked at yet
    c.track(info("w0", state=WorkerState.STARTING))  # a restart begins: only w1 serves the pool now
    clock.now = 20.0
    c.track(info("w0"))
    c.on_sample("w0", Sample(time=clock.now, queue=0, running=0, token_usage=0.0))
    assert c.backlog("w0").since == 0.0 and c.backlog("w0").waiting == 0 + 50  # the proxy still holds work for it
