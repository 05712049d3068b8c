"""Worker choice and the pacing gate, on hand-built loads (no sockets)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from proxy.engines.base import Sample
from proxy.engines.sglang.engine import SGLANG
from proxy.engines.vllm.engine import VLLM
from proxy.request.admission import AdmissionQueue, Priority
from proxy.request.attempt import Attempt, AttemptFailed, Requeued, Ticket
from proxy.request.dispatch import Dispatcher, NoWorker, QueueTimeout, choose_worker
from proxy.request.pacing import BATCH_QUEUE_BESIDE_INTERACTIVE, Band, LoadBoard, WorkerLoad
from proxy.workers.base import WorkerInfo, WorkerState

BAND = Band(lo=4, hi=10, headroom=2)  # target 6


def _workers(*states: WorkerState) -> list[WorkerInfo]:
    return [WorkerInfo(id=f"w{i}", url=f"http://w{i}", state=s, managed=True) for i, s in enumerate(states)]


def _sample(board: LoadBoard, wid: str, queue: int, running: int = 8, t: float = 100.0) -> None:
    board.get(wid).scrape_started()
    board.publish(wid, Sample(time=t, queue=queue, running=running, token_usage=0.5), None)


def _open(load: WorkerLoad) -> Attempt:
    """Reserve one attempt on the worker (what the dispatcher does when it hands a ticket over)."""
    attempt = Attempt(Ticket(Priority.BATCH, 0.0, 1.0, None), load.worker_id, 0.0)  # type: ignore[arg-type]
    load.reserve(attempt)
    return attempt


def _close(load: WorkerLoad, n: int) -> None:
    for attempt in list(load.attempts)[:n]:
        load.release(attempt)


def _choose(workers, board, now=100.0, **kw):
    return choose_worker(workers, board, band=BAND, now=now, stale_after_s=1.0, **kw)


def test_band_target():
    assert Band(lo=100, hi=2000, headroom=32).target == 132
    assert Band(lo=100, hi=110, headroom=32).target == 110  # never past the upper edge
    assert Band(lo=0, hi=0).target == 1


def test_least_loaded_and_gate():
    board = LoadBoard()
    ws = _workers(WorkerState.READY, WorkerState.READY)
    _sample(board, "w0", 5)
    _sample(board, "w1", 3)
    assert _choose(ws, board) == "w1"
    _sample(board, "w1", 6)  # at the target: closed
    assert _choose(ws, board) == "w0"
    _sample(board, "w0", 6)
    assert _choose(ws, board) is None


def test_estimate_counts_dispatches_and_completions_since_scrape():
    board = LoadBoard()
    load = board.get("w0")
    _sample(board, "w0", 3)
    for _ in range(3):
        _open(load)
    assert load.est_queue() == 6
    _close(load, 1)
    assert load.est_queue() == 5
    load.scrape_started()  # dispatched while the scrape is on the wire: still counted after it
    _open(load)
    board.publish("w0", Sample(time=101, queue=2, running=8, token_usage=0.5), None)
    assert load.est_queue() == 2 + 1  # baseline taken when the scrape was sent: counted, never missed
    _open(load)
    assert load.est_queue() == 4
    _close(load, 10)
    assert load.est_queue() == 0  # never negative
    assert load.in_flight == 0 and load.completed == 5  # a release of what is not open counts nothing


def test_not_ready_draining_and_stale_are_filtered():
    board = LoadBoard()
    ws = _workers(WorkerState.STARTING, WorkerState.READY, WorkerState.DRAINING, WorkerState.DRAINING)
    for w in ws:
        _sample(board, w.id, 0)
    _sample(board, "w1", 0, t=90.0)  # stale
    # w1 is the only one not filtered for its state; it is stale -> fallback to own counts
    assert _choose(ws, board) == "w1"
    ws[2] = dataclasses.replace(ws[2], state=WorkerState.READY)
    assert _choose(ws, board) == "w2"  # a fresh worker exists: the stale one counts as saturated


def test_fallback_uses_own_counts_when_all_stale():
    board = LoadBoard()
    ws = _workers(WorkerState.READY)
    _sample(board, "w0", 0, running=5, t=0.0)  # stale at now=100
    load = board.get("w0")
    for _ in range(5 + BAND.hi - 1):
        _open(load)
    assert _choose(ws, board) == "w0"
    _open(load)
    assert _choose(ws, board) is None  # in_flight == last_running + hi
    board.publish("w0", None, "unreachable")
    assert load.error == "unreachable" and not load.fresh(100.0, 1.0)


def test_a_restarted_worker_gets_the_bands_target_until_its_first_scrape_not_its_old_batch():
    """A worker that ran 768 restarts (with other arguments, or as one of a reshaped pool's replicas, up
    before the others): until its first scrape the fallback lets it have the band's target in flight,
    not what the incarnation before it ran plus the band."""
    board = LoadBoard()
    ws = _workers(WorkerState.READY)
    _sample(board, "w0", 0, running=768, t=0.0)
    load = board.get("w0")
    load.limit, load.queue_target = 900, 900  # the fast tier's numbers for the old process
    load.forget_sample()  # it restarted
    assert load.limit is None and load.target(BAND) == BAND.target  # the band's, until the fast tier looks again
    for _ in range(BAND.target - 1):
        _open(load)
    assert _choose(ws, board) == "w0"
    _open(load)
    assert _choose(ws, board) is None


def test_scrape_error_makes_sample_stale():
    board = LoadBoard()
    ws = _workers(WorkerState.READY, WorkerState.READY)
    _sample(board, "w0", 0)
    _sample(board, "w1", 5)
    board.publish("w0", None, "garbage page")
    assert _choose(ws, board) == "w1"


def test_exclude_prefers_other_workers_but_falls_back():
    board = LoadBoard()
    ws = _workers(WorkerState.READY, WorkerState.READY)
    _sample(board, "w0", 0)
    _sample(board, "w1", 0)
    assert _choose(ws, board, exclude=frozenset({"w0"})) == "w1"
    ws1 = _workers(WorkerState.READY)
    assert _choose(ws1, board, exclude=frozenset({"w0"})) == "w0"  # no other worker exists


def test_prefix_affinity_is_sticky_while_open():
    board = LoadBoard()
    ws = _workers(*[WorkerState.READY] * 4)
    for w in ws:
        _sample(board, w.id, 0)
    picks = {_choose(ws, board, affinity="system prompt A") for _ in range(5)}
    assert len(picks) == 1
    chosen = picks.pop()
    spread = {_choose(ws, board, affinity=f"prefix {i}") for i in range(40)}
    assert len(spread) > 1
    _sample(board, chosen, 6)  # full: the prefix goes elsewhere
    assert _choose(ws, board, affinity="system prompt A") != chosen


class _Pool:
    def __init__(self, workers):
        self.ws = workers
        self.unreachable: list[str] = []

    def workers(self):
        return self.ws

    def get(self, wid):
        return next(w for w in self.ws if w.id == wid)

    def report_unreachable(self, wid, error):
        self.unreachable.append(wid)
        self.ws = [dataclasses.replace(w, state=WorkerState.DOWN) if w.id == wid else w for w in self.ws]


async def test_dispatcher_priority_gate_and_release():
    now = [100.0]
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=2, hi=4), stale_after_s=1.0, clock=lambda: now[0])
    _sample(board, "w0", 0)
    a = d.submit(Priority.BATCH, 10)
    b = d.submit(Priority.BATCH, 10)
    c = d.submit(Priority.BATCH, 10)
    i = d.submit(Priority.INTERACTIVE, 10)
    assert a.future.done() and b.future.done() and not c.future.done() and not i.future.done()
    async with d.attempt(a) as att:
        att.mark_started()
    # a completion frees room: the interactive request overtakes the older batch one
    assert i.future.done() and not c.future.done()
    async with d.attempt(i):
        pass
    assert not c.future.done()  # beside interactive work the batch keeps one waiting at the worker (b)
    now[0] += 0.9  # the sample is still fresh, and no interactive request came for the window
    d.interactive_window_s = 0.5
    d.pump()
    assert c.future.done()
    assert board.get("w0").in_flight == 2


@pytest.mark.looptime
async def test_dispatcher_timeout_and_takeback():
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    loop = asyncio.get_running_loop()
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=1, hi=1), stale_after_s=5.0, clock=loop.time)
    _sample(board, "w0", 0, t=loop.time())
    first = d.submit(Priority.INTERACTIVE, 10)
    late = d.submit(Priority.INTERACTIVE, 0.05)
    async with d.attempt(first) as attempt:
        with pytest.raises(QueueTimeout):
            async with d.attempt(late):
                pass
        assert loop.time() == pytest.approx(0.05)
        assert len(d.admission) == 0
        assert d.take_back("w0") == 1 and attempt.taken_back
        await asyncio.sleep(10)  # the take-back cancels the block here...
        raise AssertionError("not reached")
    # ...which released the slot and put the ticket back, to the same worker (the only one)
    assert attempt.requeued is Requeued.TAKEN_BACK and attempt.released
    async with d.attempt(first) as again:
        assert again is not attempt and again.worker_id == "w0" and first.requeues == 1
        assert d.open_attempts("w0") == 1
    assert await d.wait_idle("w0", 0.5)


@pytest.mark.looptime
async def test_a_worker_down_sends_its_requests_without_output_to_another_at_once():
    """A worker reported down (its Ray actor killed: the engine may hold its connections open for
    minutes while it shuts down) gives back every request that sent nothing yet, now, to the front of
    the queue, where another worker takes it; one whose output is in runs on as before."""
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY, WorkerState.STARTING))
    loop = asyncio.get_running_loop()
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=4, hi=8), stale_after_s=1e9, clock=loop.time)
    _sample(board, "w0", 0, t=loop.time())
    streaming, waiting = d.submit(Priority.INTERACTIVE, 100), d.submit(Priority.INTERACTIVE, 100)
    streaming.future.result().mark_started()
    second: list[str] = []

    async def handler() -> None:
        async with d.attempt(waiting) as attempt:
            assert attempt.worker_id == "w0"
            await asyncio.sleep(300)  # the engine holds the connection...
            raise AssertionError("not reached")
        # ...until the block is cancelled: the attempt released, its ticket back in the queue

    task = asyncio.create_task(handler())
    await asyncio.sleep(1)  # virtual time
    pool.ws = [WorkerInfo(id="w0", url="http://w0", state=WorkerState.DOWN, managed=True),
               WorkerInfo(id="w1", url="http://w1", state=WorkerState.READY, managed=True)]  # fmt: skip
    _sample(board, "w1", 0, t=loop.time())
    d.on_worker_state(pool.ws[0])
    await task  # at once, not after the 300 s
    assert loop.time() == pytest.approx(1.0)
    async with d.attempt(waiting) as again:
        second.append(again.worker_id)
    assert second == ["w1"] and waiting.requeues == 1
    assert board.get("w0").in_flight == 1  # the stream with output runs on


def test_estimate_is_bounded_below_by_own_in_flight_minus_running():
    board = LoadBoard()
    load = board.get("w0")
    for _ in range(30):
        _open(load)
    # the scrape caught the server right after a batch finished: a short queue, 16 running...
    _sample(board, "w0", 1, running=16)
    # ...but 30 of ours are open there, so about 14 still wait
    assert load.est_queue() == 14


async def test_take_back_skips_attempts_whose_output_is_in_and_requeue_renews_patience():
    now = [100.0]
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=4, hi=8), stale_after_s=1e9, clock=lambda: now[0])
    _sample(board, "w0", 0)
    a, b, c = (d.submit(Priority.INTERACTIVE, 10) for _ in range(3))
    att_a, att_b, att_c = (t.future.result() for t in (a, b, c))
    att_a.mark_started()  # its upstream call returned: the handler relays it
    att_b.mark_started()  # streaming already
    assert d.take_back("w0") == 1 and att_c.taken_back and not att_a.taken_back
    assert d.take_back("w0") == 0  # idempotent
    now[0] = 500.0  # long after c's original deadline (110)
    async with d.attempt(c) as again:  # taken back before its handler woke: straight back to the queue
        assert c.deadline == 510.0 and c.requeues == 1
        assert again is not att_c and again.worker_id == "w0" and not again.taken_back
    assert att_c.released and board.get("w0").in_flight == 2


def _dispatcher(*states: WorkerState, max_attempts: int = 3) -> tuple[Dispatcher, _Pool, list[Requeued]]:
    board = LoadBoard()
    pool = _Pool(_workers(*states))
    requeued: list[Requeued] = []
    d = Dispatcher(
        pool,
        board,
        AdmissionQueue(100),
        band=Band(lo=4, hi=8),
        stale_after_s=1e9,
        max_attempts=max_attempts,
        on_requeue=requeued.append,
        clock=lambda: 100.0,
    )
    for w in pool.ws:
        _sample(board, w.id, 0)
    return d, pool, requeued


async def test_a_failure_before_output_is_retried_elsewhere_until_the_attempts_are_spent():
    d, pool, requeued = _dispatcher(WorkerState.READY, WorkerState.READY, max_attempts=2)
    ticket = d.submit(Priority.INTERACTIVE, 10)
    async with d.attempt(ticket) as first:
        raise AttemptFailed("HTTP 500")
    assert requeued == [Requeued.RETRY] and ticket.exclude == {first.worker_id} and ticket.failures == 1
    with pytest.raises(AttemptFailed):
        async with d.attempt(ticket) as second:
            assert second.worker_id != first.worker_id
            raise AttemptFailed("HTTP 500")
    assert ticket.failures == 2 and requeued == [Requeued.RETRY]
    assert all(d.board.get(w.id).in_flight == 0 for w in pool.ws)


async def test_an_unreachable_worker_is_reported_and_the_request_waits_without_spending_an_attempt():
    d, pool, requeued = _dispatcher(WorkerState.READY, max_attempts=1)
    ticket = d.submit(Priority.INTERACTIVE, 10)
    async with d.attempt(ticket):
        raise AttemptFailed("cannot connect", unreachable=True)
    assert pool.unreachable == ["w0"] and requeued == [Requeued.UNREACHABLE] and ticket.failures == 0
    assert not ticket.future.done() and len(d.admission) == 1  # waits for a live worker
    pool.ws = _workers(WorkerState.READY)
    d.on_worker_state(pool.ws[0])
    _sample(d.board, "w0", 0)
    d.pump()
    async with d.attempt(ticket) as attempt:
        assert attempt.worker_id == "w0"


async def test_failures_after_output_and_a_client_that_leaves_propagate_and_release():
    d, _pool, requeued = _dispatcher(WorkerState.READY)
    ticket = d.submit(Priority.INTERACTIVE, 10)
    with pytest.raises(AttemptFailed):
        async with d.attempt(ticket) as attempt:
            attempt.mark_started()
            raise AttemptFailed("broke mid-stream")
    assert attempt.released and requeued == []
    other = d.submit(Priority.INTERACTIVE, 10)

    async def client() -> None:
        async with d.attempt(other):
            await asyncio.sleep(10)  # held until the client leaves: cancelled below, never elapses

    task = asyncio.ensure_future(client())
    await asyncio.sleep(0)
    assert d.open_attempts("w0") == 1
    task.cancel()  # the client left: no requeue, the slot is free
    with pytest.raises(asyncio.CancelledError):
        await task
    assert d.open_attempts("w0") == 0 and requeued == [] and len(d.admission) == 0


def test_the_fast_tier_limit_and_queue_target_gate_a_worker():
    board = LoadBoard()
    ws = _workers(WorkerState.READY, WorkerState.READY)
    _sample(board, "w0", 2)
    _sample(board, "w1", 3)
    assert _choose(ws, board) == "w0"
    w0 = board.get("w0")
    for _ in range(3):
        _open(w0)
    w0.limit = 3  # holds as many as it may
    assert _choose(ws, board) == "w1"
    w1 = board.get("w1")
    w1.queue_target = 3  # est_queue 3: closed on w1 too
    assert _choose(ws, board) is None
    w1.queue_target = 100  # never past the band's hi (10)
    assert w1.target(BAND) == 10 and _choose(ws, board) == "w1"
    w0.limit = None
    _close(w0, 3)
    assert _choose(ws, board) == "w0"


def test_an_lpm_worker_s_queue_is_kept_on_one_side_of_its_engine_s_prefix_limit_never_across_it():
    """SGLang's lpm orders at most 128 waiting by prefix and serves a longer queue in arrival order: the
    band's target of 132 had the engine switch order round by round (prefix-none and prefix-shared both
    lost to it). The gate keeps 128, or 256 where the controller keeps the queue past the limit."""
    board, band = LoadBoard(), Band(lo=100, hi=2000, headroom=32)
    lpm = WorkerInfo(
        id="w0", url="http://w0", state=WorkerState.READY, managed=True, args={"schedule_policy": "lpm"}, pid=1
    )
    pool = _Pool([lpm])
    d = Dispatcher(pool, board, AdmissionQueue(100), band=band, stale_after_s=1e9,
                   prefix_limit=SGLANG.prefix_queue_limit, clock=lambda: 100.0)  # fmt: skip
    load = board.get("w0")
    assert load.target(band) == 132  # not known yet: the band's
    d.on_worker_state(pool.get("w0"))
    assert load.prefix_limit == 128 and load.queue_sides(band) == (128, 256) and load.target(band) == 128
    load.queue_past = True
    assert load.target(band) == 256 and load.snapshot()["queue_past"] is True
    load.batch_queue_target = 2  # beside interactive work the batch's own stays what it is
    assert load.target(band, batch=True) == 2 and load.target(band) == 256
    load.queue_target = 300  # the fast tier's own, past the limit already
    assert load.target(band) == 300
    load.queue_target, load.queue_past = None, False
    assert load.target(Band(lo=100, hi=120, headroom=32)) == 120  # a band that stops short of the limit: as it was
    assert load.queue_sides(Band(lo=100, hi=200, headroom=32)) == (128, 200)
    load.queue_past, load.held_open = True, 160
    d.on_worker_state(dataclasses.replace(lpm, state=WorkerState.DRAINING))  # a restart refused after its drain:
    d.on_worker_state(lpm)  # the same process serves again, and keeps what its looks set, as the controller does
    assert load.queue_past and load.held_open == 160 and load.target(band) == 256
    restarted = dataclasses.replace(pool.get("w0"), pid=2, args={"schedule_policy": "fcfs"})
    d.on_worker_state(restarted)  # a new process, restarted to fcfs: no limit, and no side kept
    assert load.prefix_limit is None and not load.queue_past and load.held_open is None and load.target(band) == 132


async def test_the_open_attempts_carry_what_the_planner_replays_of_the_work_in_flight():
    board = LoadBoard()
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=2, hi=4),
                   stale_after_s=1.0, clock=lambda: 100.0)  # fmt: skip
    _sample(board, "w0", 0)
    t = d.submit(Priority.BATCH, 10, prompt_tokens=250, max_tokens=2000)
    async with d.attempt(t):
        (open_now,) = board.get("w0").attempts
        assert (open_now.ticket.enqueued_at, open_now.ticket.prompt_tokens, open_now.ticket.max_tokens) == (
            100.0,
            250,
            2000,
        )
    assert not board.get("w0").attempts


def _all_running(board: LoadBoard, wid: str, t: float = 100.0) -> None:
    """A scrape that shows everything the proxy has open on the worker running, nothing waiting."""
    _sample(board, wid, 0, running=board.get(wid).in_flight, t=t)


async def test_batch_requests_keep_one_waiting_at_the_worker_while_interactive_requests_arrive():
    """Within the window after an interactive arrival, batch requests go only while the estimated worker
    queue is below BATCH_QUEUE_BESIDE_INTERACTIVE (1); each completion lets the next one go at once (no
    scrape needed); after the window, the band's target applies again."""
    now = [100.0]
    board = LoadBoard()
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=6, hi=10),
                   stale_after_s=1e9, clock=lambda: now[0], interactive_window_s=1.0)  # fmt: skip
    _sample(board, "w0", 0)
    load = board.get("w0")
    inter = d.submit(Priority.INTERACTIVE, 10)
    async with d.attempt(inter):
        pass  # answered: the worker's queue estimate is back to 0
    batch = [d.submit(Priority.BATCH, 10) for _ in range(8)]
    assert BATCH_QUEUE_BESIDE_INTERACTIVE == 1
    assert [t.future.done() for t in batch] == [True] + [False] * 7  # the queue cap, not the band's 6
    assert load.est_queue() == 1
    async with d.attempt(batch[0]):
        pass
    assert batch[1].future.done() and not batch[2].future.done()  # refilled on the completion itself
    now[0] = 101.5  # no interactive request for longer than the window
    d.pump()
    assert sum(t.future.done() for t in batch) == 1 + 6  # the band's target again: 6 estimated waiting
    for t in batch:
        t.future.cancel()


async def test_the_batch_s_share_beside_interactive_work_comes_from_the_worker_s_running_limit():
    """A worker that runs at most 16 requests at once: beside interactive work the batch holds at most 15
    there (16 less a sixteenth), less 1.25 running slots per interactive request open, so the slots kept
    for interactive requests follow their traffic; an interactive arrival takes back the newest batch
    requests beyond the share less one slot per interactive request; interactive work is never held."""
    now = [100.0]
    board = LoadBoard()
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=50, hi=60),
                   stale_after_s=1e9, clock=lambda: now[0], interactive_window_s=1.0)  # fmt: skip
    load = board.get("w0")
    load.running_limit = 16
    _sample(board, "w0", 0, running=0)
    inter = [d.submit(Priority.INTERACTIVE, 10) for _ in range(4)]
    assert all(t.future.done() for t in inter)
    batch = [d.submit(Priority.BATCH, 10) for _ in range(20)]
    for _ in range(20):  # each scrape shows them running: one more may wait at the worker
        _all_running(board, "w0")
        d.pump()
    assert load.batch_in_flight == 15 - 5  # ceil(1.25 x 4 interactive open) = 5 slots held
    for t in inter[:3]:  # three interactive answers end: one open, 15 - 2 batch allowed
        async with d.attempt(t):
            pass
    for _ in range(5):
        _all_running(board, "w0")
        d.pump()
    assert load.batch_in_flight == 13
    more = [d.submit(Priority.INTERACTIVE, 10) for _ in range(3)]
    assert all(t.future.done() for t in more)  # interactive is never held by it
    # 13 batch + 4 interactive open against 15: the two newest batch requests are taken back
    taken = [t for t in batch if t.future.done() and t.future.result().taken_back]
    assert taken == batch[11:13]
    handlers = await _wake_handlers(d, taken)  # taken back before they woke: straight back to the queue
    assert load.batch_in_flight == 11
    _all_running(board, "w0")
    d.pump()
    assert load.batch_in_flight == 11  # over the share (15 - 5): none goes until the batch is under it
    for task in handlers:
        task.cancel()
    now[0] = 101.5  # no interactive request for longer than the window: the band alone
    _all_running(board, "w0")
    d.pump()
    assert load.batch_in_flight == 11 + 7  # the seven never sent (those taken back left with their handlers)
    for t in (inter[3], *more, *batch):
        t.future.cancel()


async def test_a_worker_whose_running_limit_is_unknown_gets_the_queue_cap_but_no_share():
    """No running limit read (no server info, none in its arguments): the batch beside interactive work
    keeps one waiting at the worker and nothing is taken back, however many it runs."""
    board = LoadBoard()
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=50, hi=60),
                   stale_after_s=1e9, clock=lambda: 100.0, interactive_window_s=1.0)  # fmt: skip
    load = board.get("w0")
    _sample(board, "w0", 0, running=0)
    batch = [d.submit(Priority.BATCH, 10) for _ in range(40)]  # no interactive work: the band's 50
    assert all(t.future.done() for t in batch)
    _all_running(board, "w0")
    chat = d.submit(Priority.INTERACTIVE, 10)
    assert chat.future.done() and not any(t.future.result().taken_back for t in batch)
    later = [d.submit(Priority.BATCH, 10) for _ in range(3)]
    _all_running(board, "w0")
    d.pump()
    assert [t.future.done() for t in later] == [True, False, False]  # one waiting at the worker
    assert load.running_limit is None and load.batch_step_tokens() == 2 * 41  # paced by the most seen running
    for t in (*batch, chat, *later):
        t.future.cancel()


async def test_the_fast_tier_limit_counts_per_class_so_interactive_requests_never_wait_for_batch_ones():
    """A batch request goes while everything in flight is under the limit; an interactive one while the
    interactive ones are: a back-off squeezes the batch, and chat never waits for a batch request to end."""
    board = LoadBoard()
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=20, hi=40),
                   stale_after_s=1e9, clock=lambda: 100.0)  # fmt: skip
    _sample(board, "w0", 0, running=0)
    load = board.get("w0")
    load.limit = 4
    batch = [d.submit(Priority.BATCH, 10) for _ in range(6)]
    assert [t.future.done() for t in batch] == [True] * 4 + [False] * 2  # the limit binds the batch
    chat = [d.submit(Priority.INTERACTIVE, 10) for _ in range(5)]
    assert [t.future.done() for t in chat] == [True] * 4 + [False]  # 4 batch open do not count against chat...
    assert load.in_flight == 8 and load.batch_in_flight == 4  # ...but chat alone over the limit still waits
    async with d.attempt(batch[0]):
        pass
    assert chat[4].future.done() is False and not batch[4].future.done()  # 7 open: the batch still over the limit
    async with d.attempt(chat[0]):
        pass
    assert chat[4].future.done() and not batch[4].future.done()
    for t in (*batch[1:], *chat[1:]):
        t.future.cancel()


async def test_the_batch_queue_target_holds_batch_work_only_and_waiting_batch_requests_are_taken_back():
    now = [100.0]
    board = LoadBoard()
    requeued: list[Requeued] = []
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=6, hi=10),
                   stale_after_s=1e9, clock=lambda: now[0], on_requeue=requeued.append)  # fmt: skip
    _sample(board, "w0", 0, running=0)
    load = board.get("w0")
    batch = []
    for _ in range(5):  # sent one after another: the newest is the last in the worker's FIFO queue
        batch.append(d.submit(Priority.BATCH, 10))
        now[0] += 0.01
    assert all(t.future.done() for t in batch)
    _sample(board, "w0", 3, running=2)  # the two oldest run, three wait
    load.batch_queue_target = 1  # interactive work came: batch keeps one request waiting there
    assert load.target(Band(lo=6, hi=10), batch=True) == 1 and load.target(Band(lo=6, hi=10)) == 6
    chat = d.submit(Priority.INTERACTIVE, 10)
    assert chat.future.done()  # est_queue 3 < the band's 6: interactive still goes
    waiting = load.waiting_batch(keep=1)  # newest 4 (3 + the chat request) wait; their batch ones less the oldest
    assert [a.ticket for a in waiting] == [batch[4], batch[3]]
    assert d.withdraw_batch("w0", keep=1) == 2
    for t in batch[3:]:  # taken back before their handlers woke: straight back to the queue's batch class
        assert t.future.result().taken_back
    assert not any(t.future.result().taken_back for t in batch[:3]) and not chat.future.result().taken_back
    later = d.submit(Priority.BATCH, 10)
    assert not later.future.done()  # est_queue 4 >= the batch target 1

    async def handler(ticket: Ticket) -> None:
        async with d.attempt(ticket):
            raise AssertionError("not reached: the worker's queue is past the batch target")

    task = asyncio.create_task(handler(batch[4]))
    await asyncio.sleep(0)  # its handler wakes: the attempt is over, the ticket is at the front of the batch class
    assert requeued == [Requeued.TAKEN_BACK] and d.admission.peek() is batch[4] and load.in_flight == 5
    task.cancel()
    # the two batch requests in the proxy's queue wait for their class's target, not for the band
    assert d.held_for_class() == 2
    now[0] += 6.0  # no interactive request for the window: the dispatcher's own batch gates are off...
    assert d.held_for_class() == 2  # ...the fast tier's batch target still holds them
    load.batch_queue_target = None
    assert d.held_for_class() == 0  # the batch alone: what the proxy holds waits for the band
    load.batch_queue_target = 1
    # a scrape right after completions shows one waiting though four of ours are open beside two running:
    # the estimate errs high (4), the withdrawal reads the scrape's own queue (1) and takes nothing back
    _sample(board, "w0", 1, running=2)
    assert load.est_queue() > 1 and load.waiting_batch(keep=0) == []  # the newest one is the chat request
    for t in (*batch, chat, later):
        t.future.cancel()


async def test_batch_work_held_beside_interactive_work_is_held_for_its_class():
    """Within interactive_window_s of the latest interactive arrival, the batch requests the proxy holds
    wait for their class's gate (the journal's timid-pacing note leaves them out); past it, for the band."""
    now = [100.0]
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), LoadBoard(), AdmissionQueue(100), band=Band(lo=1, hi=2),
                   stale_after_s=1e9, clock=lambda: now[0], interactive_window_s=5.0)  # fmt: skip
    _sample(d.board, "w0", 2, running=8)  # the worker's queue at the band's top: nothing goes
    chat = d.submit(Priority.INTERACTIVE, 10)
    batch = [d.submit(Priority.BATCH, 10) for _ in range(3)]
    assert not any(t.future.done() for t in (chat, *batch)) and len(d.admission) == 4
    assert d.held_for_class() == 3  # the interactive request is the band's to send either way
    now[0] += 6.0  # the interactive window is over: the batch waits for the band
    assert d.held_for_class() == 0
    for t in (chat, *batch):
        t.future.cancel()


@pytest.mark.parametrize(("clock_rate", "wall_s"), [(10.0, 0.5), (1.0, 5.0)])
async def test_the_interactive_window_is_5_engine_seconds_on_the_worker_s_clock(clock_rate: float, wall_s: float):
    """The batch stays held beside interactive work for 5 s of the engine's clock: half a wall second on
    a worker whose clock runs 10 x the wall's, 5 on a real one."""
    now = [100.0]
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), LoadBoard(), AdmissionQueue(100), band=Band(lo=1, hi=2),
                   stale_after_s=1e9, clock=lambda: now[0], clock_rate=clock_rate)  # fmt: skip
    _sample(d.board, "w0", 2, running=8)  # the worker's queue at the band's top: nothing goes
    chat = d.submit(Priority.INTERACTIVE, 60)
    batch = d.submit(Priority.BATCH, 60)
    now[0] += wall_s * 0.99
    assert d.held_for_class() == 1  # still within the window
    now[0] += wall_s * 0.02
    assert d.held_for_class() == 0  # past it: the batch waits for the band
    for t in (chat, batch):
        t.future.cancel()


async def test_a_batch_turn_its_own_gates_hold_does_not_hold_interactive_requests():
    """The batch floor gives batch a turn every 1 / floor dispatches while both classes wait; when that
    turn comes and the batch's own gates (its queue cap beside interactive work) hold it, the
    interactive requests behind it still go, and the batch keeps its turn for when it can."""
    board = LoadBoard()
    d = Dispatcher(
        _Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100, batch_floor=0.5), band=Band(lo=50, hi=60),
        stale_after_s=1e9, clock=lambda: 100.0, interactive_window_s=10.0,
    )  # fmt: skip
    _sample(board, "w0", 0, running=0)
    first = d.submit(Priority.INTERACTIVE, 10)
    _all_running(board, "w0")
    batch = [d.submit(Priority.BATCH, 10) for _ in range(2)]
    assert first.future.done() and batch[0].future.done() and not batch[1].future.done()
    chat = [d.submit(Priority.INTERACTIVE, 10) for _ in range(6)]  # each waits beside batch[1] for an instant
    assert d.admission.peek() is batch[1]  # the floor credit reached 1: the batch's turn...
    assert all(t.future.done() for t in chat)  # ...yet no interactive request waited behind it
    _all_running(board, "w0")
    d.pump()
    assert batch[1].future.done()  # its gate opened: it goes at once
    for t in (first, *batch, *chat):
        t.future.cancel()


@pytest.mark.looptime
async def test_batch_requests_beside_interactive_work_are_paced_by_prompt_tokens_per_engine_step():
    """Beside interactive work a batch request goes to a worker only once the engine has had the time to
    take the previous ones' prompts at two tokens per running slot of the worker's limit per step (the
    step from the scrape: running / output tokens per second); a timer lets the next one go without
    waiting for another event; without interactive work the batch is not paced."""
    loop = asyncio.get_running_loop()
    board = LoadBoard()
    d = Dispatcher(
        _Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=50, hi=60),
        stale_after_s=1e9, clock=loop.time, interactive_window_s=1.0,
    )  # fmt: skip
    load = board.get("w0")
    load.running_limit = 50  # 100 prompt tokens a step

    def scrape() -> None:  # what is open runs beside 10 others, 100 output tokens/s: a step of 0.1 s
        load.scrape_started()
        board.publish("w0", Sample(time=loop.time(), queue=0, running=10, token_usage=0.5, gen_throughput=100.0), None)

    scrape()
    assert load.engine_step_s() == pytest.approx(0.1) and load.batch_step_tokens() == 100
    alone = [d.submit(Priority.BATCH, 10, prompt_tokens=50) for _ in range(3)]
    assert all(t.future.done() for t in alone)  # no interactive request yet: not paced
    for t in alone:
        async with d.attempt(t):
            pass
    chat = d.submit(Priority.INTERACTIVE, 10)
    scrape()  # the chat request runs
    batch = [d.submit(Priority.BATCH, 10, prompt_tokens=50) for _ in range(4)]
    assert chat.future.done() and [t.future.done() for t in batch] == [True, False, False, False]
    sent_at = []
    for t in batch:
        await t.future
        sent_at.append(round(loop.time(), 6))
        async with d.attempt(t):
            pass  # answered at once: the queue cap holds nothing, the pacing alone spaces them
    assert sent_at == pytest.approx([0.0, 0.05, 0.10, 0.15], abs=1e-5)  # 50 tokens at 100 a step of 0.1 s: 0.05 s apart
    await asyncio.sleep(1.0)  # the window closes: the batch goes unpaced again
    later = [d.submit(Priority.BATCH, 10, prompt_tokens=50) for _ in range(3)]
    assert all(t.future.done() for t in later)
    for t in (chat, *later):
        t.future.cancel()


async def test_an_interactive_arrival_takes_back_the_newest_batch_requests_beyond_the_reserve():
    """Batch requests beyond the batch's share beside interactive work (the worker's running limit less
    its reserve, less one slot per interactive request open there) are taken back when an interactive
    request arrives: the newest first (the least work done), so a chat request arriving after a batch
    filled the worker finds a running slot."""
    now = [100.0]
    board = LoadBoard()
    requeued: list[Requeued] = []
    d = Dispatcher(
        _Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=50, hi=60),
        stale_after_s=1e9, clock=lambda: now[0], interactive_window_s=1.0, on_requeue=requeued.append,
    )  # fmt: skip
    load = board.get("w0")
    load.running_limit = 6  # a share of 5
    _sample(board, "w0", 0, running=0)
    batch = []
    for _ in range(8):  # no interactive work: the band lets all eight go
        batch.append(d.submit(Priority.BATCH, 10))
        now[0] += 0.01
    assert all(t.future.done() for t in batch) and load.batch_in_flight == 8
    chat = d.submit(Priority.INTERACTIVE, 10)
    assert chat.future.done()
    # 8 batch + 1 interactive against 5: the four newest are taken back, the oldest four keep running
    assert [t.future.result().taken_back for t in batch] == [False] * 4 + [True] * 4
    second = d.submit(Priority.INTERACTIVE, 10)
    assert second.future.done()  # 4 (those taken back are on their way out) + 2 > 5: one more
    assert [t.future.result().taken_back for t in batch] == [False] * 3 + [True] * 5
    handlers = await _wake_handlers(d, batch[3:])  # each ticket goes back to the batch class's front
    assert requeued == [Requeued.TAKEN_BACK] * 5 and load.batch_in_flight == 3
    _all_running(board, "w0")
    d.pump()
    assert not any(t.future.done() for t in batch[3:])  # 5 - ceil(1.25 x 2) = 2 < 3 open: none goes again
    for task in handlers:
        task.cancel()
    for t in (*batch, chat, second):
        t.future.cancel()


async def _wake_handlers(d: Dispatcher, tickets: list[Ticket]) -> list[asyncio.Task[None]]:
    """Start a request handler for each ticket and let them run until they wait again (the caller cancels them)."""

    async def handler(ticket: Ticket) -> None:
        async with d.attempt(ticket):
            raise AssertionError("not reached: taken back, and nothing lets it go again")

    tasks = [asyncio.create_task(handler(t)) for t in tickets]
    for _ in range(3):
        await asyncio.sleep(0)
    return tasks


def test_the_engine_step_comes_from_the_output_gauge_or_else_the_output_counter():
    """``running / output tokens per second``: SGLang reports the rate as a gauge; vLLM only counts
    output tokens, so the rate is the counter's rise between two scrapes (a restart's drop: unknown)."""
    board = LoadBoard()
    load = board.get("w0")
    board.publish("w0", Sample(time=10.0, queue=0, running=20, token_usage=0.5, gen_throughput=1000.0), None)
    assert load.engine_step_s() == pytest.approx(0.02)
    vllm = board.get("w1")
    board.publish("w1", Sample(time=10.0, queue=0, running=20, token_usage=0.5, generation_tokens_total=5000.0), None)
    assert vllm.engine_step_s() is None  # one look: no rate yet
    board.publish("w1", Sample(time=10.5, queue=0, running=20, token_usage=0.5, generation_tokens_total=5400.0), None)
    assert vllm.engine_step_s() == pytest.approx(20 / 800.0)
    board.publish("w1", Sample(time=11.0, queue=0, running=20, token_usage=0.5, generation_tokens_total=10.0), None)
    assert vllm.engine_step_s() is None  # the counter fell: the engine restarted
    board.publish("w1", Sample(time=11.5, queue=0, running=0, token_usage=0.0, generation_tokens_total=10.0), None)
    assert vllm.engine_step_s() is None  # nothing running: no step to pace by


async def test_when_the_gate_holds_both_classes_the_batch_keeps_its_floor_turn():
    """The batch's floor turn is given to interactive work only when the batch's own gates hold it:
    when the worker has no room for anyone, nothing goes, and at the next opening the batch goes first."""
    board = LoadBoard()
    d = Dispatcher(
        _Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100, batch_floor=1.0), band=Band(lo=1, hi=1),
        stale_after_s=1e9, clock=lambda: 100.0,
    )  # fmt: skip
    _sample(board, "w0", 0, running=0)
    first = d.submit(Priority.INTERACTIVE, 10)
    assert first.future.done()  # the band's 1: the worker is full now
    batch = d.submit(Priority.BATCH, 10)
    chat = [d.submit(Priority.INTERACTIVE, 10) for _ in range(2)]
    assert not batch.future.done() and not any(t.future.done() for t in chat)
    async with d.attempt(first):
        pass  # one opening: an interactive ticket first (no credit yet), and the credit reaches 1...
    assert chat[0].future.done() and not batch.future.done()
    async with d.attempt(chat[0]):
        pass  # ...so the next opening is the batch's, though an interactive ticket waits too
    assert batch.future.done() and not chat[1].future.done()
    for t in (batch, chat[1]):
        t.future.cancel()


async def test_batch_refills_wait_while_a_streamed_interactive_request_is_overdue_for_its_first_token():
    """The fast tier's first_token_wait_s: a streamed interactive request that has waited longer than it
    at the worker holds the batch's refills there (the KV a batch request would take is what it waits
    for); not a whole answer's (its first token is not seen), not the batch's first request (the class
    always keeps one going), and they go again once its first token is out."""
    now = [100.0]
    d = Dispatcher(_Pool(_workers(WorkerState.READY)), LoadBoard(), AdmissionQueue(100), band=Band(lo=50, hi=60),
                   stale_after_s=1e9, clock=lambda: now[0], interactive_window_s=0.3)  # fmt: skip
    _sample(d.board, "w0", 0, running=8)
    load = d.board.get("w0")
    load.first_token_wait_s = 0.5  # longer than the interactive window: the batch's queue cap is off by then
    chat = d.submit(Priority.INTERACTIVE, 10)
    whole = d.submit(Priority.INTERACTIVE, 10)
    chat.future.result().streamed = True  # what the relay marks on a stream's attempt
    now[0] += 1.0  # both past the wait, no first token yet
    first = d.submit(Priority.BATCH, 10)
    assert first.future.done()  # the batch's first request goes: it has nothing on the worker yet
    second = d.submit(Priority.BATCH, 10)
    assert not second.future.done() and load.first_token_overdue(now[0])
    assert not load.has_room(now[0], batch=True) and load.has_room(now[0])  # interactive work still goes
    chat.future.result().mark_started()  # its first token: the whole answer alone holds nothing back
    d.pump()
    assert second.future.done() and not load.first_token_overdue(now[0])
    late = d.submit(Priority.INTERACTIVE, 10)
    late.future.result().streamed = True
    now[0] += 0.4  # within the wait: still its prefill's time
    third = d.submit(Priority.BATCH, 10)
    assert third.future.done()
    load.first_token_wait_s = None  # no interactive work for the hold: the fast tier lifts it
    now[0] += 10.0
    fourth = d.submit(Priority.BATCH, 10)
    assert fourth.future.done()
    load.batch_limit = 4  # the fast tier's KV sizing beside interactive work: the batch's own cap
    fifth = d.submit(Priority.BATCH, 10)
    assert not fifth.future.done() and load.has_room(now[0])  # the batch's cap holds the batch alone
    load.batch_limit = 5
    d.pump()
    assert fifth.future.done()
    for t in (chat, whole, first, second, late, third, fourth, fifth):
        t.future.cancel()


def test_the_open_requests_kv_is_estimated_from_prompts_steps_since_sent_and_the_class_s_expected_output():
    board = LoadBoard()
    load = board.get("w0")

    def open_one(priority: Priority, prompt: int, max_tokens: int, at: float) -> Attempt:
        ticket = Ticket(priority, 0.0, 1.0, None, prompt_tokens=prompt, max_tokens=max_tokens)  # type: ignore[arg-type]
        attempt = Attempt(ticket, "w0", at)
        load.reserve(attempt, batch=priority is Priority.BATCH)
        return attempt

    open_one(Priority.BATCH, 400, 2000, 0.0)  # 100 steps ago at 0.1 s a step
    open_one(Priority.INTERACTIVE, 600, 4096, 9.0)  # 10 steps ago
    capped = open_one(Priority.INTERACTIVE, 600, 4096, 9.5)
    capped.sent_max_tokens = 768  # its output budget: the most it writes on this worker
    open_one(Priority.BATCH, 300, 2000, 9.9)  # the newest: waiting in the worker's queue
    _sample(board, "w0", 1, running=3)
    # the batch's answers: prompts of 350 as the engine counted them, 1,600 written; the chat class has no
    # answers yet: its prompts as the proxy estimated them and its max_tokens stand
    expected = {False: (350.0, 1600.0), True: (None, None)}
    assert load.open_requests(10.0, 0.1, expected.__getitem__, interactive=False) == [
        (350, 1600),  # waiting there: nothing written yet
        (450, 1500),  # 100 steps written
    ]
    assert load.open_requests(10.0, 0.1, expected.__getitem__, interactive=True) == [
        (605, 763),  # 5 steps of at most 768
        (610, 4086),
    ]
    no_step = load.open_requests(10.0, 0.0, expected.__getitem__, interactive=False)
    assert no_step[-1] == (350, 1600)  # no step time: nothing written


def test_what_the_engine_s_admission_counts_taken_is_estimated_from_the_same_open_requests():
    """Each open request counts by the engine's rule (here SGLang's: a running one its prompt, what it
    wrote and its remaining max_tokens times the live ratio; one still waiting its prompt and whole
    max_tokens, clipped at 4,096); the next interactive request's need is added, and one more batch
    request's count is the newest batch request's once running."""
    board = LoadBoard()
    load = board.get("w0")

    def open_one(priority: Priority, prompt: int, max_tokens: int | None, at: float) -> Attempt:
        ticket = Ticket(priority, 0.0, 1.0, None, prompt_tokens=prompt, max_tokens=max_tokens)  # type: ignore[arg-type]
        attempt = Attempt(ticket, "w0", at)
        load.reserve(attempt, batch=priority is Priority.BATCH)
        return attempt

    open_one(Priority.BATCH, 400, 2000, 0.0)  # 100 steps ago at 0.1 s a step: 450 held, 1,900 left
    open_one(Priority.INTERACTIVE, 600, None, 9.0)  # no max_tokens: the engine counts 4,096 of it
    open_one(Priority.BATCH, 300, 2000, 9.9)  # the newest: waiting in the worker's queue
    _sample(board, "w0", 1, running=2)
    prompts = {False: 350.0, True: None}
    engine = SGLANG

    def reserve(held: int, may_write: int, running: bool) -> int:
        return engine.admission_reserve(held, may_write, running=running, ratio=0.5)

    taken = (350 + 100 + 950) + (600 + 10 + 2048) + (350 + 2000)
    assert load.admission_taken(10.0, 0.1, prompts.__getitem__, reserve) == taken
    shares = load.admission_shares(10.0, 0.1, prompts.__getitem__, reserve, 100_000)
    assert shares == ((taken + 600 + 4096) / 100_000, (350 + 1000) / 100_000)
    # an engine that reserves nothing counts what each holds
    vllm = VLLM
    held = load.admission_taken(
        10.0, 0.1, prompts.__getitem__, lambda h, m, r: vllm.admission_reserve(h, m, running=r, ratio=None)
    )
    assert held == 450 + 610 + 350


async def test_nothing_is_taken_back_while_the_proxy_stops():
    board = LoadBoard()
    d = Dispatcher(
        _Pool(_workers(WorkerState.READY)), board, AdmissionQueue(100), band=Band(lo=4, hi=8), stale_after_s=1e9
    )
    _sample(board, "w0", 0)
    batch, interactive = d.submit(Priority.BATCH, 10), d.submit(Priority.INTERACTIVE, 10)
    attempts = [t.future.result() for t in (interactive, batch)]
    d.close()  # the drain began: what is on a worker ends there, a take-back could only be refused
    assert d.take_back("w0") == 0 and d.take_back_newest_batch("w0", 1) == 0 and d.fail_over("w0") == 0
    assert not any(a.taken_back for a in attempts)


async def test_when_every_worker_stays_down_requests_are_refused_not_queued():
    """The controller gave each worker up (the policy revives none): what waits fails with
    :class:`NoWorker` as the last one is given up, a new request at once, a requeue too; while one
    worker may still come back, requests wait for it."""
    down = dataclasses.replace(_workers(WorkerState.DOWN)[0], last_error="killed by SIGKILL")
    pool = _Pool([down, dataclasses.replace(down, id="w1")])
    d = Dispatcher(pool, LoadBoard(), AdmissionQueue(100), band=Band(lo=1, hi=4), stale_after_s=1.0, clock=lambda: 0.0)
    waiting = [d.submit(Priority.INTERACTIVE, 60), d.submit(Priority.BATCH, 60)]
    gone = dataclasses.replace(down, stays_down=True, last_error="killed by SIGKILL; it stays down")
    pool.ws = [gone, pool.ws[1]]
    d.on_worker_state(gone)  # w1 may still come back: they wait
    assert not any(t.future.done() for t in waiting) and len(d.admission) == 2
    pool.ws = [gone, dataclasses.replace(gone, id="w1")]
    d.on_worker_state(pool.ws[1])
    for ticket in waiting:
        with pytest.raises(
            NoWorker, match=r"every worker is down and stays down \(w0 down, stays down; w1 down, stays down\)"
        ):
            ticket.future.result()
    assert len(d.admission) == 0
    with pytest.raises(NoWorker):
        d.submit(Priority.INTERACTIVE, 60)
    ticket = Ticket(Priority.BATCH, 0.0, 60.0, asyncio.get_running_loop().create_future())
    d._requeue(ticket, Attempt(ticket, "w0", 0.0), Requeued.UNREACHABLE)  # a request the worker's death gave back
    with pytest.raises(NoWorker):
        ticket.future.result()


async def test_a_pool_in_a_crash_loop_refuses_until_a_worker_serves():
    """A crash loop the controller only revives: refused at once (the error says one may serve
    again), and served again once a worker is READY (the pool lifts the loop's mark)."""
    looping = dataclasses.replace(
        _workers(WorkerState.STARTING)[0],
        crash_loop=True,
        last_error="exited with code 2: error: unrecognized arguments",
    )
    gone = dataclasses.replace(looping, id="w1", crash_loop=False, stays_down=True, state=WorkerState.DOWN)
    pool = _Pool([looping, gone])
    board = LoadBoard()
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=1, hi=4), stale_after_s=1.0, clock=lambda: 100.0)
    with pytest.raises(NoWorker, match="every worker is down or in a crash loop") as refused:
        d.submit(Priority.INTERACTIVE, 60)
    assert not refused.value.for_good and "(w0 starting, in a crash loop; w1 down, stays down)" in str(refused.value)
    assert "unrecognized" not in str(refused.value)  # the worker's output is not a client's to read
    pool.ws = [dataclasses.replace(looping, state=WorkerState.READY, crash_loop=False), gone]
    d.on_worker_state(pool.ws[0])  # the pool tells its listeners
    _sample(board, "w0", 0)
    assert d.submit(Priority.INTERACTIVE, 60).future.done()


def test_a_worker_not_scraped_since_it_started_is_gated_on_its_own_counts_beside_fresh_ones():
    """Workers up at once (a reshape's replicas): one scraped first must not take all the traffic while the
    others, not scraped yet, count as saturated; each is gated on what is in flight there until its
    first scrape."""
    board = LoadBoard()
    ws = _workers(WorkerState.READY, WorkerState.READY)
    _sample(board, "w0", 0, running=0)
    fresh, new = board.get("w0"), board.get("w1")
    assert new.unscraped and new.est_queue() == 0
    for _ in range(BAND.target):
        _open(fresh)
    assert _choose(ws, board) == "w1"  # w0 at its target: the unscraped one takes the next
    for _ in range(BAND.target - 1):
        _open(new)
    assert _choose(ws, board) == "w1"
    _open(new)
    assert new.est_queue() == BAND.target and _choose(ws, board) is None
    board.publish("w1", None, "unreachable")  # a failed scrape: stale, not unscraped
    assert not new.unscraped


def test_a_new_process_under_the_same_id_is_not_read_by_the_old_ones_samples():
    """The scraper reads a draining worker until it stops; the new process under the same id (restarted, or
    a reshape's replica) comes up READY with a new pid: the old process's sample is forgotten, and a scrape
    begun before that is dropped when it comes back. Until its own first scrape the new one is gated on
    its own counts."""
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    d = Dispatcher(pool, board, AdmissionQueue(100), band=BAND, stale_after_s=1.0, clock=lambda: 100.0)
    load = board.get("w0")
    d.on_worker_state(dataclasses.replace(pool.get("w0"), pid=1))
    _sample(board, "w0", 0, running=768)  # the old process, running 768
    load.scrape_started()  # a scrape of it on the wire ...
    d.on_worker_state(dataclasses.replace(pool.get("w0"), pid=2))  # ... when the new process is READY
    board.publish("w0", Sample(time=100.0, queue=0, running=768, token_usage=0.5), None)
    assert load.sample is None and load.unscraped and load.incarnation == 2
    board.publish("w0", None, "unreachable")  # the old process's last scrape, failing as it died: dropped too
    assert load.unscraped
    _sample(board, "w0", 3, running=10)  # the new process's own first scrape
    assert load.sample is not None and load.sample.running == 10
    d.on_worker_state(dataclasses.replace(pool.get("w0"), pid=2))  # the same process again: kept
    assert load.sample is not None


async def test_an_lpm_pool_sends_a_waiting_request_whose_prefix_runs_and_answered_before_older_ones():
    """The dispatcher tells the queue what runs and what answered: once a request with ``p`` answered
    while another with ``p`` runs, the waiting ``p`` overtakes the older ``q``."""
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    admission = AdmissionQueue(100, prefix_first=SGLANG.prefix_queue_limit({"schedule_policy": "lpm"}) or 0)
    d = Dispatcher(pool, board, admission, band=Band(lo=2, hi=2), stale_after_s=1e9, prefix_affinity=True,
                   clock=lambda: 100.0)  # fmt: skip
    _sample(board, "w0", 0)
    p1, p2 = d.submit(Priority.BATCH, 10, "p"), d.submit(Priority.BATCH, 10, "p")
    q1, p3 = d.submit(Priority.BATCH, 10, "q"), d.submit(Priority.BATCH, 10, "p")
    assert p1.future.done() and p2.future.done() and not q1.future.done()
    async with d.attempt(p1) as att:
        att.mark_started()  # p1 answers; p2 still runs: the worker has p cached
    assert p3.future.done() and not q1.future.done()
