"""Fair admission, pure: deficit round robin by tokens between keys, the batch floor, requeue."""

from __future__ import annotations

import asyncio
import random

import pytest

from proxy.request.admission import AdmissionQueue, Priority, QueueFull, estimate_cost
from proxy.request.attempt import Ticket

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def _t(p: Priority, key: str, cost: int) -> Ticket:
    return Ticket(p, 0.0, 10.0, asyncio.get_running_loop().create_future(), key=key, cost=cost)


def _waiting(q: AdmissionQueue, key: str) -> int:
    """The key's tickets waiting, both classes, as ``/metrics`` reads them."""
    return sum(stats.waiting for _, k, stats in q.stats() if k == key)


def _dispatched_tokens(q: AdmissionQueue, pops: int) -> dict[str, int]:
    got: dict[str, int] = {}
    for _ in range(pops):
        t = q.pop()
        assert t is not None
        got[t.key] = got.get(t.key, 0) + t.cost
    return got


@pytest.mark.parametrize("weights", [{"big": 1.0, "small": 1.0}, {"big": 1.0, "small": 3.0}])
async def test_backlogged_keys_get_tokens_by_weight_not_by_requests(weights):
    """'big' sends 8k-token requests, 'small' 100-token ones; both always backlogged."""
    q = AdmissionQueue(1_000_000, weights=weights)
    for _ in range(400):
        q.push(_t(BATCH, "big", 8000))
    for _ in range(30_000):
        q.push(_t(BATCH, "small", 100))
    got = _dispatched_tokens(q, 2000)
    share = got["small"] / (got["small"] + got["big"])
    want = weights["small"] / (weights["small"] + weights["big"])
    assert share == pytest.approx(want, rel=0.1)


async def test_ten_times_the_requests_does_not_buy_ten_times_the_share():
    rng = random.Random(7)
    q = AdmissionQueue(1_000_000)
    for _ in range(10_000):
        q.push(_t(INTERACTIVE, "heavy", rng.randint(50, 2000)))
    for _ in range(1_000):
        q.push(_t(INTERACTIVE, "light", rng.randint(50, 2000)))
    got = _dispatched_tokens(q, 1200)  # both still backlogged at the end
    assert got["heavy"] / got["light"] == pytest.approx(1.0, rel=0.1)


async def test_a_lone_key_is_never_held_back_and_fifo_within_a_key():
    q = AdmissionQueue(100)
    ts = [_t(BATCH, "a", c) for c in (100_000, 5, 70_000)]
    for t in ts:
        q.push(t)
    assert [q.pop() for _ in range(3)] == ts
    assert q.pop() is None


async def test_interactive_goes_first_but_batch_keeps_its_floor():
    q = AdmissionQueue(100_000, batch_floor=0.05)
    for _ in range(5000):
        q.push(_t(INTERACTIVE, "i", 100))
        q.push(_t(BATCH, "b", 100))
    order = [q.pop().priority for _ in range(2000)]  # type: ignore[union-attr]
    batch = order.count(BATCH)
    assert batch == pytest.approx(100, abs=2)  # 5% of what went while both waited
    assert max(len(run) for run in "".join("b" if p is BATCH else "i" for p in order).split("i")) == 1


async def test_no_floor_means_strict_priority_and_batch_alone_goes_at_once():
    q = AdmissionQueue(100, batch_floor=0.0)
    b = _t(BATCH, "b", 1)
    q.push(b)
    i = [_t(INTERACTIVE, "i", 1) for _ in range(3)]
    for t in i:
        q.push(t)
    assert [q.pop() for _ in range(4)] == [*i, b]


async def test_an_interactive_arrival_goes_before_a_batch_ticket_already_peeked():
    q = AdmissionQueue(100)
    b = _t(BATCH, "b", 1)
    q.push(b)
    assert q.peek() is b
    i = _t(INTERACTIVE, "i", 1)
    q.push(i)
    assert q.peek() is i


async def test_requeued_ticket_goes_before_its_key_and_the_backlogged_keys():
    q = AdmissionQueue(100)
    a1, a2, b1, c1, c2 = (_t(BATCH, k, 10) for k in "aabcc")
    for t in (a1, a2, b1, c1, c2):
        q.push(t)
    assert [q.pop() for _ in range(3)] == [a1, b1, c1]  # each new key's first; then they take turns
    q.requeue(c1)
    assert q.pop() is c1  # before a2, whose turn was next
    q.requeue(b1)  # b had nothing else waiting
    assert q.pop() is b1
    assert {q.pop(), q.pop()} == {a2, c2} and q.pop() is None


async def test_cancel_and_stats_per_key():
    q = AdmissionQueue(100)
    a, b = _t(BATCH, "a", 10), _t(BATCH, "b", 20)
    q.push(a)
    q.push(b)
    q.cancel(a)
    assert q.pop() is b and q.pop() is None
    assert {k: s.dispatched for _, k, s in q.stats()} == {"a": 0, "b": 0}  # popped: not yet sent
    q.record_dispatch(b, 1.5)
    stats = {(p, k): s for p, k, s in q.stats()}
    assert stats[(BATCH, "b")].dispatched_tokens == 20 and stats[(BATCH, "b")].wait_s == 1.5
    assert stats[(BATCH, "a")].waiting == 0 and stats[(BATCH, "a")].dispatched == 0


def test_cost_estimate():
    assert estimate_cost(4000, 100, 256) == 1100
    assert estimate_cost(400, None, 256, n=2) == 100 + 512
    assert estimate_cost(0, 10**11, 256) == 1 << 20  # the engine refuses it; it must get there to be refused


async def test_a_light_keys_request_goes_before_the_rest_of_a_backlogged_keys_turn():
    q = AdmissionQueue(1000)
    for _ in range(200):
        q.push(_t(INTERACTIVE, "heavy", 60))  # a turn of 4096 tokens is ~68 of these
    assert [q.pop().key for _ in range(3)] == ["heavy"] * 3
    light = _t(INTERACTIVE, "light", 60)
    q.push(light)
    assert q.pop() is light  # not after the 65 left of heavy's turn
    assert q.pop().key == "heavy"
    big = _t(INTERACTIVE, "light", 10_000)  # more than its one quantum: it waits its turn in the ring
    q.push(big)
    assert all(q.pop().key == "heavy" for _ in range(60))


async def test_a_full_queue_pushes_out_the_newest_of_the_key_holding_the_most():
    q = AdmissionQueue(10)
    heavy = [_t(INTERACTIVE, "heavy", 10) for _ in range(9)]
    for t in heavy:
        q.push(t)
    batch = _t(BATCH, "heavy", 10)
    q.push(batch)
    with pytest.raises(QueueFull):  # the key holding the most gets the 429 itself
        q.push(_t(INTERACTIVE, "heavy", 10))
    light = _t(INTERACTIVE, "light", 10)
    assert q.push(light) is batch  # the newest of heavy's, batch before interactive
    assert batch.cancelled and not batch.queued and len(q) == 10 and _waiting(q, "heavy") == 9
    assert q.push(_t(INTERACTIVE, "light", 10)) is heavy[-1]
    for _ in range(3):
        q.push(_t(INTERACTIVE, "light", 10))
    assert _waiting(q, "light") == 5 and _waiting(q, "heavy") == 5
    with pytest.raises(QueueFull):  # even: nobody is pushed out
        q.push(_t(INTERACTIVE, "light", 10))
    assert q.push(_t(INTERACTIVE, "third", 10)) is not None  # a third key still gets in


async def test_a_ticket_taken_back_from_the_key_whose_turn_it_is_passes_the_turn_on():
    q = AdmissionQueue(100_000)
    for key in "abc":
        for _ in range(2000):
            q.push(_t(INTERACTIVE, key, 100))
    got = {"a": 0, "b": 0, "c": 0}
    for n in range(1, 601):
        t = q.pop()
        got[t.key] += 1  # dispatches, the ones taken back too
        if t.key == "a" and n % 5 == 0:
            t.queued = False
            q.requeue(t)  # a worker died under it: back at the front, with its cost refunded
    assert got["b"] == pytest.approx(got["c"], rel=0.15)  # b's turns had been skipped (10 of 600, c 300)
    assert got["a"] == pytest.approx(got["c"], rel=0.15)  # and a lost none for what it had taken back


async def test_a_key_keeping_one_request_waiting_gets_no_more_than_its_share():
    q = AdmissionQueue(100_000)
    for _ in range(2000):
        q.push(_t(INTERACTIVE, "backlogged", 100))
    q.push(_t(INTERACTIVE, "sparse", 100))
    got = {"backlogged": 0, "sparse": 0}
    for _ in range(1000):
        t = q.pop()
        got[t.key] += 1
        if t.key == "sparse":
            q.push(_t(INTERACTIVE, "sparse", 100))  # its next, as soon as the last went: never two waiting
    assert got["sparse"] / 1000 <= 0.55  # it had jumped the ring with every request (79 %)


async def test_a_batch_arrival_never_pushes_out_interactive_work():
    q = AdmissionQueue(4)
    for _ in range(4):
        q.push(_t(INTERACTIVE, "heavy", 10))
    with pytest.raises(QueueFull):
        q.push(_t(BATCH, "light", 10))
    assert q.push(_t(INTERACTIVE, "light", 10)) is not None
