"""A worker's saturated pace, and an output budget's measured gain on it: only the scrapes that saw work
waiting count, a run of them only once the batch settled; the gain is the pace with the budget over
the pace with it held back, each read once the worker's batch turned over; a side with too little
says so."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.control.budget_gain import Cohort
from proxy.control.budget_outcome import PendingBudget, advance, check_outcome
from proxy.control.saturation import Pace, saturated_pace
from proxy.control.window import Window
from proxy.engines.base import Sample

SETTLE, ENOUGH, WINDOW = 20.0, 20.0, 60.0
COHORT = Cohort(True, 4096)


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


def test_a_load_ramping_up_does_not_count() -> None:
    # idle, then a load whose first 20 s the engine fills its batch (half the pace), then settled
    ramp = _window((10, 0.0, 0, 0), (20, 500.0, 30, 0), (25, 1000.0, 30, 0))
    pace = saturated_pace(ramp, 0.0, ramp.now, settle_s=SETTLE, enough_s=ENOUGH)
    assert pace.tok_per_s == pytest.approx(1000.0) and pace.seconds == pytest.approx(ENOUGH)
    assert pace.run_began == 11.0 and ramp.busy().throughput < 900.0  # the busy window holds the ramp


def test_idle_spells_and_a_batch_its_own_gates_hold_are_not_saturated_time() -> None:
    # saturated at 1000 tokens/s, with idle spells (no work waiting) at other paces between (the later
    # run: the proxy holds requests for it, its server queue empty)
    spells = _window((45, 1000.0, 30, 0), (5, 200.0, 0, 0), (25, 1000.0, 0, 40))
    assert spells.busy().throughput < 950.0
    pace = saturated_pace(spells, 0.0, spells.now, settle_s=SETTLE)
    assert pace.tok_per_s == pytest.approx(1000.0) and pace.run_began == 51.0
    # the batch its class's own gates hold in the proxy (beside interactive work) is not work waiting
    gated = _window((40, 1000.0, 0, 10), gated=True)
    assert saturated_pace(gated, 0.0, gated.now, settle_s=SETTLE) == Pace()
    assert Pace().tok_per_s is None


class _Worker:
    """A worker under a closed load whose requests stay ``stay`` s on it: its pace is ``held`` or
    ``budgeted`` tokens/s by what the requests it runs were sent with, once they all went the same
    way (a mixed batch: as held back); ``ramp``: its batch filling afresh (half the pace) for its first
    seconds; no work waits for it after ``saturated_until``."""

    def __init__(self, stay: int, held: float, budgeted: float, ramp: int = 0, saturated_until: float = 1e9) -> None:
        self.stay, self.held, self.budgeted, self.ramp, self.until = stay, held, budgeted, ramp, saturated_until
        self.sent: list[tuple[float, bool]] = []  # when its open requests were sent, and with the budget?
        self.window, self.total = Window(span_s=120.0, since=0.0), 0.0

    def scrape(self, t: int) -> tuple[Window, list[float]]:
        """Its window with the scrape at ``t``, and when the requests open on it were sent."""
        self.sent = [(s, b) for s, b in self.sent if s > t - self.stay]
        rate = self.budgeted if self.sent and all(b for _, b in self.sent) else self.held
        rate *= 0.5 if t < self.ramp else 1.0
        waiting = t <= self.until
        self.total += rate if waiting and t > 0 else 0.0
        sample = Sample(time=t, queue=30 if waiting else 0, running=100, token_usage=0.5,
                        generation_tokens_total=self.total)  # fmt: skip
        self.window = self.window.push(sample).push_proxy_queue(t, 0)
        return self.window, [s for s, _ in self.sent]

    def send(self, at: float, budget: bool) -> None:
        self.sent.append((at, budget))


def _check(worker: _Worker, decided: int, until: int = 400) -> tuple[PendingBudget | str, Callable[[int], bool]]:
    """A budget decided at ``decided`` on ``worker``, its check stepped at each scrape (a second apart,
    requests sent between them): done, or why not; and whether the requests sent after a scrape went
    with the budget."""
    went: dict[int, bool] = {}
    pending: PendingBudget | str | None = None
    for t in range(until):
        window, open_sent = worker.scrape(t)
        if t == decided:
            began = saturated_pace(window, t - WINDOW, t, settle_s=SETTLE).run_began
            pending = PendingBudget.opened(1, COHORT, t, {}, None, began, (4096, 640))
        elif isinstance(pending, PendingBudget):
            pending = advance(pending, window, open_sent, t, settle_s=SETTLE, enough_s=ENOUGH, window_s=WINDOW,
                              stay_s=worker.stay)  # fmt: skip
            if isinstance(pending, str) or pending.done(ENOUGH):
                return pending, went.__getitem__
        went[t] = t >= decided and not (isinstance(pending, PendingBudget) and pending.held_back is not None)
        worker.send(t + 0.5, went[t])
    raise AssertionError("the check did not end")


def test_a_budget_set_while_the_batch_fills_is_measured_against_itself_held_back() -> None:
    # the budget comes 15 s into the load, the engine still filling its batch: no settled pace before it
    worker = _Worker(stay=10, held=1000.0, budgeted=1200.0, ramp=25)
    done, went = _check(worker, decided=15)
    assert isinstance(done, PendingBudget), done
    with_budget, held = done.with_budget, done.held_back
    assert held is not None
    # each side read once the requests sent the other way had ended, and the batch settled
    assert with_budget.turned_over is not None and with_budget.turned_over - 15 >= worker.stay - 1
    assert with_budget.pace.tok_per_s == pytest.approx(1200.0) and with_budget.pace.seconds >= ENOUGH
    assert held.turned_over is not None and held.turned_over - held.switched >= worker.stay - 1
    assert held.pace.tok_per_s == pytest.approx(1000.0)
    assert not went(int(held.switched)) and went(int(held.switched) - 1)  # held back from its switch
    outcome, fields = check_outcome(done, None)
    assert fields["measured_gain"] == pytest.approx(0.2) and fields["measured_throughput"] == pytest.approx(1200.0)
    assert outcome["with_budget"]["sent_max_tokens"] == 640 and outcome["held_back"]["sent_max_tokens"] == 4096
    assert outcome["held_back"]["saturated_throughput"] == pytest.approx(1000.0) and outcome["verdict"] == "better"


def test_a_budget_moved_is_held_back_to_the_budget_before_it() -> None:
    pending = PendingBudget.opened(2, COHORT, 0.0, {}, None, None, (768, 1024))
    assert (pending.sent_now, pending.held_tokens) == (1024, 768)
    assert PendingBudget.opened(3, COHORT, 0.0, {}, None, None, (4096, 640)).held_tokens is None  # as asked


def test_a_load_that_ends_or_a_batch_that_does_not_turn_over_says_why_it_is_not_measured() -> None:
    ended = _Worker(stay=10, held=1000.0, budgeted=1200.0, saturated_until=30)  # settled from 20 s, turned over at 16 s
    why, _ = _check(ended, decided=5)
    assert why == (
        "with the budget, the worker was saturated, its batch settled (a run's first 20 s not counted), "
        "for 10.0 s of the 20 s a measure needs, in the 60 s after its batch turned over"
    )
    pending = PendingBudget.opened(1, COHORT, 100.0, {}, None, None, (4096, 640))
    window = _window((10, 1000.0, 30, 0), start=100.0)
    still = advance(pending, window, [99.0], 168.0, settle_s=SETTLE, enough_s=ENOUGH, window_s=WINDOW, stay_s=9.0)
    # within a window past the longest stay
    assert isinstance(still, PendingBudget) and still.with_budget.turned_over is None
    why_not = advance(pending, window, [99.0], 169.0, settle_s=SETTLE, enough_s=ENOUGH, window_s=WINDOW, stay_s=9.0)
    assert why_not == "requests of the class sent before the budget were still open on the worker 69.0 s after it"
    outcome, fields = check_outcome(pending, None, why_not)
    assert fields["not_measured"] == why_not and "measured_gain" not in fields and "verdict" not in outcome
