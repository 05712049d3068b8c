"""The proxy queue where the pool's engine sorts by prefix: a waiting request whose prefix is ready
(requests with it run on a worker and one of them has answered) goes before older ones of its key,
the key's oldest passed over at most ``prefix_first`` times; and the replays' model of that order
(:mod:`proxy.sim.prefix_first`) picks as the queue does."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.request.admission import AdmissionQueue, Priority
from proxy.request.attempt import Ticket
from proxy.sim.prefix_first import PrefixFirst

BATCH = Priority.BATCH


def _push(q: AdmissionQueue, prefixes: str, key: str = "k") -> list[Ticket]:
    loop = asyncio.get_running_loop()
    out = [Ticket(BATCH, 0.0, 10.0, loop.create_future(), None if p == "." else p, key=key) for p in prefixes]
    for t in out:
        q.push(t)
    return out


def _run(q: AdmissionQueue, n: int) -> list[Ticket]:
    """Pop ``n`` tickets, each starting on a worker as it goes."""
    out = []
    for _ in range(n):
        t = q.pop()
        assert t is not None
        q.on_worker(t, 1)
        out.append(t)
    return out


async def test_a_ready_prefix_goes_before_older_ones() -> None:
    q = AdmissionQueue(100, prefix_first=8)
    ts = _push(q, "ppqqp")
    first, _ = _run(q, 2)
    assert _run(q, 1) == [ts[2]]  # p runs twice, none has answered: the worker may not have computed it
    q.on_worker(first, -1, answered=True)  # one answered while the other runs: the worker has p cached
    assert _run(q, 2) == [ts[4], ts[3]]
    assert q.sent_ahead == 1  # what /metrics counts (pacer_prefix_first_requests_total)


async def test_the_queue_says_whether_two_requests_it_holds_share_a_prefix() -> None:
    """What the planner's queue side reads: waiting here or on a worker, two with one prefix."""
    q = AdmissionQueue(100, prefix_first=8)
    _push(q, "pq.")
    assert not q.prefixes.any_shared()
    (p,) = _run(q, 1)
    _push(q, "p")  # one of p on a worker, one waiting
    assert q.prefixes.any_shared()
    q.on_worker(p, -1, answered=True)
    assert not q.prefixes.any_shared()
    both = _run(q, 3)  # q, the unkeyed one and the second p all on workers
    assert not q.prefixes.any_shared()
    _push(q, "q")
    assert q.prefixes.any_shared() and len(both) == 3


async def test_a_prefix_is_ready_only_while_a_request_with_it_runs() -> None:
    q = AdmissionQueue(100, prefix_first=8)
    ts = _push(q, "ppqp")
    for t in _run(q, 2):
        q.on_worker(t, -1, answered=True)  # none with p runs now: the worker may evict it
    assert _run(q, 2) == [ts[2], ts[3]] and not q.prefixes.ready


async def test_the_oldest_is_passed_over_at_most_the_limit() -> None:
    q = AdmissionQueue(100, prefix_first=2)
    _push(q, "pp")
    q.on_worker(_run(q, 2)[0], -1, answered=True)
    ts = _push(q, "qppp")
    assert _run(q, 4) == [ts[1], ts[2], ts[0], ts[3]]  # q passed over twice, then it goes


async def test_the_oldest_of_the_ready_prefixes_goes_first() -> None:
    q = AdmissionQueue(100, prefix_first=8)
    _push(q, "ppqq")
    p1, _, q1, _ = _run(q, 4)
    q.on_worker(p1, -1, answered=True)
    q.on_worker(q1, -1, answered=True)
    ts = _push(q, "rqp")
    assert _run(q, 3) == [ts[1], ts[2], ts[0]]


async def test_without_the_engine_sorting_by_prefix_the_key_is_fifo() -> None:
    q = AdmissionQueue(100)
    ts = _push(q, "ppqqp")
    first, _ = _run(q, 2)
    q.on_worker(first, -1, answered=True)
    assert _run(q, 3) == ts[2:] and not q.prefixes.ready


async def test_a_ticket_taken_back_goes_first_and_a_cancelled_one_never() -> None:
    q = AdmissionQueue(100, prefix_first=8)
    cold, p1, _ = _push(q, "qpp")
    _run(q, 3)
    q.on_worker(p1, -1, answered=True)
    q.on_worker(cold, -1)  # taken back from its worker before it answered: the head of its key again
    q.requeue(cold)
    p3, p4 = _push(q, "pp")
    assert _run(q, 1) == [cold]  # before the ready p's: it keeps its place
    assert q.cancel(p4)
    assert _run(q, 1) == [p3] and q.pop() is None
    assert q.held() == q._dead  # only the cancelled ticket's two entries are left, counted dead


async def test_keys_keep_their_shares_and_each_sorts_its_own() -> None:
    plain, q = AdmissionQueue(100, quantum=1), AdmissionQueue(100, prefix_first=8, quantum=1)
    for queue in (plain, q):
        _push(queue, "pp", key="a")
        _push(queue, "qq", key="b")
        first_p, first_q, _, _ = _run(queue, 4)
        queue.on_worker(first_p, -1, answered=True)
        queue.on_worker(first_q, -1, answered=True)
    a = _push(q, "rp", key="a")
    b = _push(q, "sq", key="b")
    _push(plain, "rp", key="a"), _push(plain, "sq", key="b")
    got = _run(q, 4)
    assert [t.key for t in got] == [t.key for t in _run(plain, 4)]  # the round robin is untouched
    assert [t for t in got if t.key == "a"] == [a[1], a[0]]
    assert [t for t in got if t.key == "b"] == [b[1], b[0]]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(("p", "q", "r", None))),
        st.tuples(st.just("pop"), st.just(0)),
        st.tuples(st.sampled_from(("answer", "back", "fail")), st.integers(0, 40)),
    ),
    max_size=200,
)


def _same_picks(ops: list[tuple[str, object]], limit: int) -> None:
    """Run ``ops`` through the queue (one key, everything arrived) and through the model of its order:
    both give out the same requests in the same order."""
    loop = asyncio.new_event_loop()
    try:
        q = AdmissionQueue(10_000, quantum=1 << 30, prefix_first=limit)
        prefixes: list[str | None] = []
        model = PrefixFirst(lambda i: prefixes[i], limit)
        tickets: list[Ticket] = []
        running: list[int] = []
        for op, arg in ops:
            if op == "push":
                tickets.append(Ticket(BATCH, 0.0, 10.0, loop.create_future(), arg, key="k"))  # type: ignore[arg-type]
                prefixes.append(arg)  # type: ignore[arg-type]
                q.push(tickets[-1])
                model.add([len(tickets) - 1])
            elif op == "pop":
                t = q.pop()
                if t is None:
                    assert model.head() is None
                    continue
                assert model.take(lambda i: True) == tickets.index(t)
                q.on_worker(t, 1)
                running.append(tickets.index(t))
            elif running:
                i = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
                q.on_worker(tickets[i], -1, answered=op == "answer")
                model.ended(i, answered=op == "answer")
                if op == "back":
                    q.requeue(tickets[i])
                    model.add([i], front=True)
        while (t := q.pop()) is not None:
            assert model.take(lambda i: True) == tickets.index(t)
        assert model.head() is None
    finally:
        loop.close()


def test_the_model_keeps_a_taken_back_request_first_as_the_queue_does() -> None:
    push = [("push", p) for p in "qpp"]
    _same_picks([*push, ("pop", 0), ("pop", 0), ("pop", 0), ("answer", 1), ("back", 0), ("push", "p"), ("pop", 0)], 8)


@settings(max_examples=400, deadline=None)
@given(ops=OPS, limit=st.integers(1, 4))
def test_the_replays_model_picks_as_the_queue_does(ops, limit) -> None:  # type: ignore[no-untyped-def]
    """Any sequence of arrivals, dispatches, answers, take-backs and failures."""
    _same_picks(ops, limit)
