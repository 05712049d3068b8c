"""A worker's saturated pace, and an output budget's measured gain on it: only the scrapes that saw work
waiting count, a run of them only once the batch settled, and a side with too little says so."""

from __future__ import annotations

import pytest

from proxy.control.budget_gain import Cohort
from proxy.control.budget_outcome import PendingBudget, window_outcome
from proxy.control.saturation import Pace, saturated_pace
from proxy.control.window import Window
from proxy.engines.base import Sample

SETTLE, ENOUGH = 20.0, 20.0


def _window(*phases: tuple[int, float, int, int], start: float = 0.0, gated: bool = False) -> Window:
    """A scrape a second from ``start`` (as the first phase) over ``phases`` of (seconds, output
    tokens/s, server queue, requests the proxy holds: ``gated``, by their class's own gates), the
    output counter going on across them."""
    w, total = Window(span_s=120.0, since=start), 0.0
    times = iter(range(int(start), int(start) + 1 + sum(p[0] for p in phases)))
    for k, (seconds, rate, queue, held) in enumerate(phases):
        for t in [next(times) for _ in range(seconds + (k == 0))]:
            total += rate if t > start else 0.0
            w = w.push(Sample(time=t, queue=queue, running=100 if rate else 0, token_usage=0.5,
                              generation_tokens_total=total))  # fmt: skip
            w = w.push_proxy_queue(t, held, held if gated else 0)
    return w


def _outcome(before: Window, decided: float, after: Window) -> dict:
    pace = saturated_pace(before, decided - 60.0, decided, settle_s=SETTLE, enough_s=ENOUGH)
    pending = PendingBudget(1, Cohort(True, 4096), decided, decided + 60.0, before.busy().summary(), None, pace)
    paced = saturated_pace(after, decided, after.now, settle_s=SETTLE, began=pace.run_began)
    return window_outcome(
        pending, after.after(decided).busy().summary(), paced, None, settle_s=SETTLE, enough_s=ENOUGH
    )[1]


def test_a_load_ramping_up_before_the_budget_does_not_count() -> None:
    # idle, then a load whose first 20 s the engine fills its batch (half the pace), then settled
    ramp = _window((10, 0.0, 0, 0), (20, 500.0, 30, 0), (25, 1000.0, 30, 0))
    pace = saturated_pace(ramp, 0.0, ramp.now, settle_s=SETTLE, enough_s=ENOUGH)
    assert pace.tok_per_s == pytest.approx(1000.0) and pace.seconds == pytest.approx(ENOUGH)
    assert pace.run_began == 11.0 and ramp.busy().throughput < 900.0  # the busy window holds the ramp
    # a budget set 25 s into the load: its ramp is all the window before has, so nothing is measured
    early = _window((10, 0.0, 0, 0), (15, 500.0, 30, 0), (10, 800.0, 30, 0))
    after = _window((60, 1200.0, 30, 0), start=early.now)
    fields = _outcome(early, early.now, after)
    assert "measured_gain" not in fields
    assert (
        fields["not_measured"]
        == "the worker was saturated, its batch settled (a run's first 20 s not counted), for 4.0 s before it, of the 20 s a measure needs"
    )


def test_the_saturated_pace_after_over_before_is_the_gain() -> None:
    # before: saturated at 1000 tokens/s, with idle spells (no work waiting) at other paces between
    # (the later run: the proxy holds requests for it, its server queue empty), and a slower spell
    before = _window((45, 1000.0, 30, 0), (5, 200.0, 0, 0), (25, 1000.0, 0, 40))
    assert before.busy().throughput < 950.0
    # the run ongoing at the decision goes on after it: it settled before, the window after need not wait
    after = _window((60, 1500.0, 30, 0), start=before.now)
    fields = _outcome(before, before.now, after)
    assert fields["measured_gain"] == pytest.approx(0.5) and fields["measured_throughput"] == pytest.approx(1500.0)
    # the batch its class's own gates hold in the proxy (beside interactive work) is not work waiting
    gated = _window((40, 1000.0, 0, 10), gated=True)
    assert saturated_pace(gated, 0.0, gated.now, settle_s=SETTLE) == Pace()


def test_too_little_saturated_time_after_the_budget_says_so() -> None:
    before = _window((60, 1000.0, 30, 0))
    after = _window((10, 1500.0, 30, 0), (50, 300.0, 0, 0), start=before.now)  # the load ended
    fields = _outcome(before, before.now, after)
    assert (
        fields["not_measured"]
        == "the worker was saturated, its batch settled (a run's first 20 s not counted), for 10.0 s after it, of the 20 s a measure needs"
    )
    assert Pace().tok_per_s is None
