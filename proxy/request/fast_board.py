"""The fast tier's decision written to the load board: a worker's output budgets, its limit and
queue targets, the batch requests taken back from it, and a pump of its pool's gate when any of
that changed. The decision is the controller's (``proxy.control.fast_decision``); this module reads
it through the protocols below, so the request path knows nothing of the controller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from proxy.request.dispatch import Dispatcher
from proxy.request.pacing import WorkerLoad

_log = logging.getLogger(__name__)


class BudgetValue(Protocol):
    """An output budget after a look (None: none; ``overrun``: lifted, read again from the next answers)."""

    @property
    def interactive(self) -> bool: ...
    @property
    def asked(self) -> int: ...
    @property
    def tokens(self) -> int | None: ...
    @property
    def overrun(self) -> bool: ...


class LoadDecision(Protocol):
    """One look's decision for one worker, as the board takes it."""

    @property
    def time(self) -> float: ...
    @property
    def limit(self) -> int | None: ...
    @property
    def queue_target(self) -> int | None: ...
    @property
    def batch_queue_target(self) -> int | None: ...
    @property
    def batch_limit(self) -> int | None: ...
    @property
    def first_token_wait_s(self) -> float | None: ...
    @property
    def take_back_batch(self) -> int: ...
    @property
    def kv_peak_share(self) -> float | None: ...
    @property
    def budgets(self) -> Sequence[BudgetValue]: ...
    @property
    def reason(self) -> str: ...


def apply_decision(worker_id: str, decision: LoadDecision, load: WorkerLoad, dispatcher: Dispatcher) -> None:
    """Write ``decision`` into the worker's ``load``: its budgets, then its take-backs (beside
    interactive work, batch requests waiting at the worker past the batch's queue target; none when
    an interactive request is overdue for its first token: it waits there for room, and each batch
    request queued ahead of it needs more KV free than it does); a change pumps the pool's gate."""
    for move in decision.budgets:
        key = (move.interactive, move.asked)
        if move.overrun:
            load.output_budgets.lift_as_overrun(key, decision.time)
        else:
            load.output_budgets.set(key, move.tokens, decision.time)
    load.first_token_wait_s = decision.first_token_wait_s
    withdrawn = 0
    if decision.take_back_batch:
        withdrawn = dispatcher.take_back_newest_batch(worker_id, decision.take_back_batch)
        _log.info(
            "fast tier %s: %d batch requests taken back: the open requests' KV heads to %.2f of the pool",
            worker_id,
            withdrawn,
            decision.kv_peak_share,
        )
    if decision.batch_queue_target is not None and load.batch_in_flight:
        keep = 0 if load.first_token_held_up(decision.time) else decision.batch_queue_target
        queued = dispatcher.withdraw_batch(worker_id, keep=keep)
        withdrawn += queued
        if queued:
            _log.info(
                "fast tier %s: %d batch requests back from the worker's queue (interactive work)", worker_id, queued
            )
    now = (decision.limit, decision.queue_target, decision.batch_queue_target, decision.batch_limit)
    if now != (load.limit, load.queue_target, load.batch_queue_target, load.batch_limit) or withdrawn:
        if decision.limit != load.limit:
            _log.info("fast tier %s: %s", worker_id, decision.reason)
        load.limit, load.queue_target, load.batch_queue_target, load.batch_limit = now
        dispatcher.pump()
