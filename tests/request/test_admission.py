"""The proxy queue: strict priority, FIFO within a class, capacity, cancel, requeue at the front."""

from __future__ import annotations

import asyncio

import pytest

from proxy.request.admission import AdmissionQueue, Priority, QueueFull
from proxy.request.attempt import Ticket

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


def _t(p: Priority, name: str) -> Ticket:
    t = Ticket(p, 0.0, 10.0, asyncio.get_running_loop().create_future())
    t.affinity = name
    return t


def _drain(q: AdmissionQueue) -> list[str]:
    out = []
    while (t := q.pop()) is not None:
        out.append(t.affinity)
    return out


async def test_interactive_first_fifo_within_class():
    q = AdmissionQueue(10)
    for p, n in [(BATCH, "b1"), (INTERACTIVE, "i1"), (BATCH, "b2"), (INTERACTIVE, "i2")]:
        q.push(_t(p, n))
    assert len(q) == 4 and q.depth(INTERACTIVE) == 2 and q.depth(BATCH) == 2
    assert _drain(q) == ["i1", "i2", "b1", "b2"]
    assert len(q) == 0


async def test_capacity_counts_live_tickets_only():
    q = AdmissionQueue(2)
    a, b = _t(INTERACTIVE, "a"), _t(BATCH, "b")
    q.push(a)
    q.push(b)
    with pytest.raises(QueueFull, match="2 requests waiting"):
        q.push(_t(INTERACTIVE, "c"))
    assert q.cancel(a) is True
    assert q.cancel(a) is False  # twice is harmless
    q.push(_t(INTERACTIVE, "c"))
    assert _drain(q) == ["c", "b"]


async def test_requeue_goes_to_front_of_its_class_even_when_full():
    q = AdmissionQueue(2)
    first = _t(BATCH, "first")
    q.push(first)
    q.push(_t(BATCH, "second"))
    assert q.pop() is first
    q.push(_t(BATCH, "third"))
    q.requeue(first)  # accepted once: never refused for capacity
    assert len(q) == 3 and first.requeues == 1
    assert _drain(q) == ["first", "second", "third"]


async def test_cancelled_tickets_are_skipped_and_compacted():
    q = AdmissionQueue(10_000, compact_slack=10)
    tickets = [_t(INTERACTIVE, str(i)) for i in range(100)]
    for t in tickets:
        q.push(t)
    for t in tickets[:95]:
        q.cancel(t)
    assert len(q) == 5
    assert q.held() < 40  # dead entries were compacted away
    assert _drain(q) == [str(i) for i in range(95, 100)]


async def test_on_change_called_on_push_and_requeue():
    calls = []
    q = AdmissionQueue(5, on_change=lambda: calls.append(1))
    t = _t(INTERACTIVE, "x")
    q.push(t)
    q.pop()
    q.requeue(t)
    assert len(calls) == 2
