"""SGLang's priority scheduling in the simulator: queue order, preemption, flags, the request field."""

from __future__ import annotations

import pytest

from proxy.sim.config import SimConfigError
from proxy.sim.request import State
from tests.sim.helpers import config, engine, run_until, unique_prompt


def _add(eng, salt: int, priority: int | None, max_new: int = 64):  # type: ignore[no-untyped-def]
    return eng.add(prompt_ids=unique_prompt(50, salt), max_new_tokens=max_new, ignore_eos=True, priority=priority)


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    eng = engine("--enable-priority-scheduling", "--max-running-requests", "1")
    first = _add(eng, 0, None)
    run_until(eng, lambda: first.state is State.RUNNING)
    low_a, low_b = _add(eng, 1, 0), _add(eng, 2, 0)
    high = _add(eng, 3, 5)  # arrives last, higher value: first by default
    nameless = _add(eng, 4, None)  # no priority: the least important
    order: list[str] = []
    reqs = [low_a, low_b, high, nameless]
    run_until(
        eng,
        lambda: (
            order.extend(r.rid for r in reqs if r.state is not State.WAITING and r.rid not in order)
            or all(r.state is State.FINISHED for r in reqs)
        ),
    )
    assert order == [high.rid, low_a.rid, low_b.rid, nameless.rid]


def test_low_values_first_reverses_the_order() -> None:
    eng = engine("--enable-priority-scheduling", "--schedule-low-priority-values-first", "--max-running-requests", "1")
    first = _add(eng, 0, None)
    run_until(eng, lambda: first.state is State.RUNNING)
    big, small = _add(eng, 1, 5), _add(eng, 2, 1)
    run_until(eng, lambda: small.state is not State.WAITING)
    assert big.state is State.WAITING


def test_without_the_flag_the_field_is_ignored_and_the_queue_is_fcfs() -> None:
    eng = engine("--max-running-requests", "1")
    first = _add(eng, 0, None)
    run_until(eng, lambda: first.state is State.RUNNING)
    low, high = _add(eng, 1, 0), _add(eng, 2, 100)
    run_until(eng, lambda: low.state is not State.WAITING)
    assert high.state is State.WAITING


def test_a_more_important_request_preempts_a_full_batch() -> None:
    eng = engine("--enable-priority-scheduling", "--max-running-requests", "2")
    batch = [_add(eng, i, 0, max_new=500) for i in range(2)]
    run_until(eng, lambda: all(r.state is State.RUNNING for r in batch) and eng.output_len(batch[1]) > 5)
    urgent = _add(eng, 9, 100, max_new=8)
    run_until(eng, lambda: urgent.state is State.FINISHED)
    # the latest queued of the least important went back to the queue and is recomputed later
    assert batch[1].num_retractions == 1 and batch[0].num_retractions == 0
    assert batch[0].state is not State.FINISHED
    run_until(eng, lambda: all(r.state is State.FINISHED for r in batch))
    assert all(eng.output_len(r) == 500 for r in batch)


def test_no_preemption_within_the_threshold() -> None:
    eng = engine("--enable-priority-scheduling", "--max-running-requests", "2")  # threshold 10 by default
    batch = [_add(eng, i, 0, max_new=200) for i in range(2)]
    run_until(eng, lambda: all(r.state is State.RUNNING for r in batch))
    near = _add(eng, 9, 10, max_new=8)  # a difference of 10 is not more than 10
    run_until(eng, lambda: near.state is not State.WAITING)
    assert all(r.state is State.FINISHED and r.num_retractions == 0 for r in batch)


def test_threshold_flag_and_policy_check() -> None:
    assert (
        config(
            "--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "3"
        ).priority_scheduling_preemption_threshold
        == 3
    )
    with pytest.raises(SimConfigError, match="fcfs or lof"):
        config("--enable-priority-scheduling", "--schedule-policy", "lpm")
