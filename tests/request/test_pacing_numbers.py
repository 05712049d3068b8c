"""The interactive protection's numbers, derived from a worker's running-request limit (pure functions),
and where a worker's load keeps what it knows of that limit."""

from __future__ import annotations

import pytest

from proxy.engines.base import Sample
from proxy.request.pacing import (
    LoadBoard,
    batch_in_flight_cap,
    batch_prefill_tokens_per_step,
    slots_held_for_interactive,
)


@pytest.mark.parametrize(
    ("limit", "cap"),
    [(256, 240), (1024, 960), (48, 45), (16, 15), (8, 7), (2, 1), (1, 1)],
)
def test_the_batch_share_is_the_running_limit_less_a_sixteenth_at_least_one_slot_each(limit: int, cap: int) -> None:
    assert batch_in_flight_cap(limit) == cap  # 256 -> 240: the design that met the Batch API's target


def test_batch_prompt_tokens_per_step_are_two_per_running_slot() -> None:
    assert batch_prefill_tokens_per_step(256) == 512  # the measured design's 512
    assert batch_prefill_tokens_per_step(8) == 16
    assert batch_prefill_tokens_per_step(0) == 2  # never a zero rate


def test_slots_kept_for_interactive_requests_are_a_quarter_more_than_they_hold() -> None:
    assert [slots_held_for_interactive(n) for n in (0, 1, 2, 4, 8)] == [0, 2, 3, 5, 10]


def test_a_worker_s_limit_is_kept_until_it_restarts_and_its_pacing_falls_back_to_what_it_was_seen_running() -> None:
    board = LoadBoard()
    load = board.get("w0")
    assert load.batch_step_tokens() is None  # nothing known: unpaced
    board.publish("w0", Sample(time=1.0, queue=0, running=30, token_usage=0.5), None)
    board.publish("w0", Sample(time=2.0, queue=0, running=12, token_usage=0.5), None)
    assert load.running_limit is None and load.running_seen == 30
    assert load.batch_step_tokens() == 60 and load.batch_room_beside_interactive()  # no share without a limit
    load.running_limit = 256  # read from its server info
    assert load.batch_step_tokens() == 512 and load.snapshot()["running_limit"] == 256
    load.forget_sample()  # it restarted: its limit is read again (the controller may have moved it)
    assert load.running_limit is None and load.running_seen == 0
