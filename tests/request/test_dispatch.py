"""Worker choice and the pacing gate, on hand-built loads (no sockets)."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.request.admission import AdmissionQueue, Priority
from proxy.request.dispatch import Dispatcher, QueueTimeout, choose_worker
from proxy.engines.base import Sample
from proxy.request.pacing import Band, LoadBoard
from proxy.workers.base import WorkerInfo, WorkerState

BAND = Band(lo=4, hi=10, headroom=2)  # target 6


def _workers(*states: WorkerState) -> list[WorkerInfo]:
    return [WorkerInfo(id=f"w{i}", url=f"http://w{i}", state=s, managed=True) for i, s in enumerate(states)]


def _sample(board: LoadBoard, wid: str, queue: int, running: int = 8, t: float = 100.0) -> None:
    board.get(wid).scrape_started()
    board.publish(wid, Sample(time=t, queue=queue, running=running, token_usage=0.5), None)


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
        load.reserve()
    assert load.est_queue() == 6
    load.release()
    assert load.est_queue() == 5
    load.scrape_started()  # dispatched while the scrape is on the wire: still counted after it
    load.reserve()
    board.publish("w0", Sample(time=101, queue=2, running=8, token_usage=0.5), None)
    assert load.est_queue() == 2 + 1  # baseline taken when the scrape was sent: counted, never missed
    load.reserve()
    assert load.est_queue() == 4
    for _ in range(10):
        load.release()
    assert load.est_queue() == 0  # never negative


def test_not_ready_draining_and_stale_are_filtered():
    board = LoadBoard()
    ws = _workers(WorkerState.STARTING, WorkerState.READY, WorkerState.READY, WorkerState.DRAINING)
    for w in ws:
        _sample(board, w.id, 0)
    _sample(board, "w1", 0, t=90.0)  # stale
    board.get("w2").draining = True
    # w1 is the only one not filtered for state/draining; it is stale -> fallback to own counts
    assert _choose(ws, board) == "w1"
    board.get("w2").draining = False
    assert _choose(ws, board) == "w2"  # a fresh worker exists: the stale one counts as saturated


def test_fallback_uses_own_counts_when_all_stale():
    board = LoadBoard()
    ws = _workers(WorkerState.READY)
    _sample(board, "w0", 0, running=5, t=0.0)  # stale at now=100
    load = board.get("w0")
    for _ in range(5 + BAND.hi - 1):
        load.reserve()
    assert _choose(ws, board) == "w0"
    load.reserve()
    assert _choose(ws, board) is None  # in_flight == last_running + hi
    board.publish("w0", None, "unreachable")
    assert load.error == "unreachable" and not load.fresh(100.0, 1.0)


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

    def workers(self):
        return self.ws

    def get(self, wid):
        return next(w for w in self.ws if w.id == wid)


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
    att = a.future.result()
    d.mark_started(att)
    d.release(att)  # a completion frees room: the interactive request overtakes the older batch one
    assert i.future.done() and not c.future.done()
    d.release(i.future.result())
    assert c.future.done()
    assert board.get("w0").in_flight == 2


async def test_dispatcher_timeout_and_takeback():
    board = LoadBoard()
    pool = _Pool(_workers(WorkerState.READY))
    d = Dispatcher(pool, board, AdmissionQueue(100), band=Band(lo=1, hi=1), stale_after_s=5.0)
    _sample(board, "w0", 0, t=time.monotonic())
    first = d.submit(Priority.INTERACTIVE, 10)
    attempt = await d.assigned(first)
    late = d.submit(Priority.INTERACTIVE, 0.05)
    with pytest.raises(QueueTimeout):
        await d.assigned(late)
    assert len(d.admission) == 0
    assert d.take_back("w0") == 1 and attempt.taken_back
    d.release(attempt)
    assert await d.wait_idle("w0", 0.5)
    d.requeue(first)
    again = await d.assigned(first)
    assert again is not attempt and again.worker_id == "w0" and first.requeues == 1


def test_estimate_is_bounded_below_by_own_in_flight_minus_running():
    board = LoadBoard()
    load = board.get("w0")
    for _ in range(30):
        load.reserve()
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
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    d.start(att_a, done)  # its upstream call already returned: the handler relays it
    d.mark_started(att_b)  # streaming already
    assert d.take_back("w0") == 1 and att_c.taken_back and not att_a.taken_back
    assert d.take_back("w0") == 0  # idempotent
    now[0] = 500.0  # long after c's original deadline (110)
    d.release(att_c)
    d.requeue(c)
    assert c.deadline == 510.0
    again = await d.assigned(c)
    assert again.worker_id == "w0" and not again.taken_back
