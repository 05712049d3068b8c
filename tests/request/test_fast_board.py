"""The fast tier's decision written to a real load board through a real dispatcher: budgets, the
limit that gates, take-backs, and the pump that follows a change."""

from __future__ import annotations

from dataclasses import replace

from proxy.control.fast_decision import BudgetMove, FastDecision
from proxy.engines.base import Sample
from proxy.request.admission import AdmissionQueue, Priority
from proxy.request.dispatch import Dispatcher
from proxy.request.fast_board import apply_decision
from proxy.request.pacing import Band, LoadBoard
from proxy.workers.base import WorkerInfo, WorkerState

NOTHING = FastDecision(
    time=5.0,
    limit=None,
    queue_target=None,
    batch_queue_target=None,
    batch_limit=None,
    first_token_wait_s=None,
    take_back_batch=0,
    kv_peak_share=None,
    budgets=(),
    evidence=(),
    reason="",
)


class _ReadyPool:
    """One ready worker (what the dispatcher reads of a pool)."""

    def __init__(self) -> None:
        self.ws = [WorkerInfo(id="w0", url="http://w0", state=WorkerState.READY, managed=True)]

    def workers(self) -> list[WorkerInfo]:
        return self.ws

    def get(self, _worker_id: str) -> WorkerInfo:
        return self.ws[0]


def _dispatcher() -> tuple[LoadBoard, Dispatcher]:
    board = LoadBoard()
    d = Dispatcher(_ReadyPool(), board, AdmissionQueue(100), band=Band(lo=4, hi=64, headroom=4),  # type: ignore[arg-type]
                   stale_after_s=1e9, clock=lambda: 1.0)  # fmt: skip
    board.publish("w0", Sample(time=1.0, queue=0, running=0, token_usage=0.1), None)
    return board, d


async def test_budgets_are_set_and_an_overrun_one_is_lifted_and_read_again_from_then():
    board, d = _dispatcher()
    load = board.get("w0")
    load.output_budgets.set((True, 2048), 512, 1.0)
    moves = (
        BudgetMove(interactive=False, asked=4096, tokens=768),
        BudgetMove(interactive=True, asked=2048, tokens=None, overrun=True),
    )
    apply_decision("w0", replace(NOTHING, budgets=moves), load, d)
    assert load.output_budgets.get((False, 4096)) == 768 and load.output_budgets.set_at((False, 4096)) == 5.0
    assert load.output_budgets.get((True, 2048)) is None and load.output_budgets.read_from((True, 2048)) == 5.0
    assert load.output_budgets.read_from((False, 4096)) == -float("inf")


async def test_a_new_limit_is_written_and_the_pump_sends_what_it_lets_through():
    board, d = _dispatcher()
    load = board.get("w0")
    apply_decision("w0", replace(NOTHING, limit=2, queue_target=2), load, d)
    assert (load.limit, load.queue_target) == (2, 2)
    sent = [d.submit(Priority.INTERACTIVE, 100) for _ in range(3)]
    assert [t.future.done() for t in sent] == [True, True, False]  # the limit gates the third
    apply_decision("w0", replace(NOTHING, limit=3, queue_target=3, batch_limit=8, first_token_wait_s=0.1), load, d)
    assert sent[2].future.done()  # the change pumped the gate
    assert (load.limit, load.batch_limit, load.first_token_wait_s) == (3, 8, 0.1)
    for t in sent:
        t.future.cancel()


async def test_take_backs_return_the_newest_batch_requests_to_the_queue():
    board, d = _dispatcher()
    load = board.get("w0")
    batch = [d.submit(Priority.BATCH, 100) for _ in range(4)]
    assert all(t.future.done() for t in batch)
    apply_decision("w0", replace(NOTHING, take_back_batch=2, batch_limit=2, kv_peak_share=1.2), load, d)
    assert [t.future.result().taken_back for t in batch] == [False, False, True, True]
    assert load.batch_limit == 2
    for t in batch:
        t.future.cancel()
