"""Fair admission under any sequence of operations (hypothesis): no ticket is lost or given twice,
the round robin's books stay whole (each key with credit is a new key or in the ring, never both),
and a full queue pushes out only a first-time ticket of a key holding more, of the arriving class
or a lower one."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.request.admission import ORDER, AdmissionQueue, Priority, QueueFull
from proxy.request.attempt import Ticket

KEYS = ("a", "b", "c", "d")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(ORDER), st.sampled_from(KEYS), st.integers(1, 9000)),
        st.tuples(st.just("pop"), st.sampled_from((None, *ORDER))),
        st.tuples(st.just("requeue"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
    ),
    max_size=120,
)


def _books_whole(q: AdmissionQueue) -> None:
    for p in ORDER:
        c = q._classes[p]
        fresh, ring = list(c.fresh), list(c.ring)
        assert len(set(fresh)) == len(fresh) and len(set(ring)) == len(ring)
        assert not set(fresh) & set(ring) and set(fresh) | set(ring) == set(c.deficit)
        assert all(credit >= 0 for credit in c.deficit.values())
        waiting = {k for k, queue in c.queues.items() if any(t.queued for t in queue)}
        assert waiting <= set(c.deficit)  # every key with a ticket waiting gets turns


@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 12))
def test_no_ticket_is_lost_or_given_twice_and_the_books_stay_whole(ops, capacity) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.new_event_loop()
    try:
        q = AdmissionQueue(capacity, quantum=4096)
        waiting: list[Ticket] = []  # in the queue, by the test's own count
        popped: list[Ticket] = []  # given out, not back
        for op in ops:
            if op[0] == "push":
                _, p, key, cost = op
                t = Ticket(p, 0.0, 10.0, loop.create_future(), key=key, cost=cost)
                held = {k: sum(1 for w in waiting if w.key == k) for k in KEYS}
                try:
                    out = q.push(t)
                except QueueFull:
                    assert len(waiting) >= capacity
                    continue
                if out is not None:
                    assert len(waiting) >= capacity and out in waiting and out.requeues == 0
                    assert out.key != key and held[out.key] > held[key] + 1
                    assert out.priority is p or out.priority is Priority.BATCH  # batch never pushes out interactive
                    waiting.remove(out)
                else:
                    assert len(waiting) < capacity
                waiting.append(t)
            elif op[0] == "pop":
                t = q.pop(op[1])
                if t is None:
                    assert not [w for w in waiting if op[1] is None or w.priority is op[1]]
                else:
                    assert t in waiting and (op[1] is None or t.priority is op[1]) and not t.queued
                    waiting.remove(t)
                    popped.append(t)
            elif op[0] == "requeue" and popped:
                t = popped.pop(op[1] % len(popped))
                q.requeue(t)  # beyond capacity too: it was accepted once
                waiting.append(t)
            elif op[0] == "cancel" and waiting:
                t = waiting.pop(op[1] % len(waiting))
                assert q.cancel(t)
            assert len(q) == len(waiting)
            _books_whole(q)
        rest = []
        while (t := q.pop()) is not None:
            rest.append(t)
        assert sorted(map(id, rest)) == sorted(map(id, waiting))  # the rest, each once
        _books_whole(q)
    finally:
        loop.close()


PREFIXES = ("p", "q", None)
PREFIX_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(ORDER), st.sampled_from(KEYS[:2]), st.sampled_from(PREFIXES)),
        st.tuples(st.just("pop"), st.sampled_from((None, *ORDER))),
        st.tuples(st.sampled_from(("requeue", "cancel", "answer", "fail")), st.integers(0, 50)),
    ),
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(ops=PREFIX_OPS, limit=st.integers(1, 3))
def test_prefix_first_gives_each_ticket_once_and_keeps_its_books(ops, limit) -> None:  # type: ignore[no-untyped-def]
    """With ``prefix_first`` (its order: tests/request/test_prefix_first.py): every ticket goes once, the
    round robin's books stay whole and the dead entries' count is exact, cancelled ones included."""
    loop = asyncio.new_event_loop()
    try:
        q = AdmissionQueue(1000, quantum=4096, prefix_first=limit)
        waiting: list[Ticket] = []
        running: list[Ticket] = []
        for op in ops:
            if op[0] == "push":
                _, p, key, prefix = op
                t = Ticket(p, 0.0, 10.0, loop.create_future(), prefix, key=key, cost=3000)
                q.push(t)
                waiting.append(t)
            elif op[0] == "pop":
                t = q.pop(op[1])
                if t is None:
                    assert not [w for w in waiting if op[1] is None or w.priority is op[1]]
                    continue
                assert t in waiting and not t.queued and (op[1] is None or t.priority is op[1])
                waiting.remove(t)
                running.append(t)
                q.on_worker(t, 1)
            elif op[0] == "cancel" and waiting:
                assert q.cancel(waiting.pop(op[1] % len(waiting)))
            elif op[0] in ("requeue", "answer", "fail") and running:
                t = running.pop(op[1] % len(running))
                q.on_worker(t, -1, answered=op[0] == "answer")
                if op[0] == "requeue":
                    q.requeue(t)
                    waiting.append(t)
            assert len(q) == len(waiting) and q._dead >= 0
            assert q.held() - q._dead == len(waiting) + sum(1 for w in waiting if w.affinity is not None)
            _books_whole(q)
        rest = []
        while (t := q.pop()) is not None:
            rest.append(t)
        assert sorted(map(id, rest)) == sorted(map(id, waiting))
        assert q.held() == q._dead
    finally:
        loop.close()
