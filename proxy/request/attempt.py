"""A request's place in the proxy (:class:`Ticket`, from admission until it leaves) and its tries:
one try on one worker (:class:`Attempt`), and why one ended without output.

An attempt is made by the dispatcher when it hands a queued ticket to a worker, and lives until
the ``async with dispatcher.attempt(ticket)`` block that owns it exits
(:meth:`proxy.request.dispatch.Dispatcher.attempt`). While it lives it is in its worker's set of
open attempts (:attr:`proxy.request.pacing.WorkerLoad.attempts`), the one count of what this proxy
has in flight there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from proxy.policy import Priority
from proxy.workers.base import WorkerId

if TYPE_CHECKING:
    from proxy.request.continuation import Part

__all__ = ["Attempt", "AttemptFailed", "Requeued", "TakenBack", "Ticket", "WorkerLost"]


class Ticket:
    """One request's place in the proxy queue, from admission until it leaves the proxy.

    ``future`` resolves to the :class:`Attempt` the dispatcher made for it. ``exclude`` names workers this
    request already failed on (retries go elsewhere when another worker exists). ``affinity`` is
    a short prefix key for prefix-aware choice (``None`` when the policy does not ask for it).
    ``key`` is the configured name of the caller's API key (its share of admission; never the secret)
    and ``cost`` the request's estimated tokens (prompt + completion), what fair admission charges.
    """

    __slots__ = (
        "affinity",
        "cancelled",
        "cost",
        "deadline",
        "enqueued_at",
        "exclude",
        "failures",
        "future",
        "key",
        "max_tokens",
        "order",
        "patience",
        "priority",
        "prompt_tokens",
        "queued",
        "requeues",
        "written",
    )

    def __init__(
        self,
        priority: Priority,
        enqueued_at: float,
        deadline: float,
        future: asyncio.Future[Attempt],
        affinity: str | None = None,
        *,
        key: str = "",
        cost: int = 1,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.priority = priority
        self.key = key
        self.cost = max(1, cost)
        self.prompt_tokens = prompt_tokens  # estimated (None: not known); read by the planner's replay
        self.max_tokens = max_tokens  # as asked (None: not given)
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.patience = deadline - enqueued_at  # a requeued ticket may wait this long again
        self.future = future
        self.exclude: frozenset[str] = frozenset()
        self.affinity = affinity
        self.queued = False  # in a deque and counted in len()
        self.order = 0  # its place in its key's line: the queue numbers each push up, each requeue down
        self.cancelled = False
        self.requeues = 0  # how many times it went back to the queue
        self.failures = 0  # attempts that failed before output (each one spent of ``max_attempts``)
        # what a worker had written of the answer when the request was taken back from it (the parts of
        # :mod:`proxy.request.continuation`): the next attempt goes on from there instead of starting over
        self.written: tuple[Part, ...] = ()

    def let_go(self, attempt: Attempt) -> None:
        """``attempt`` is over: a future resolved to it (not yet replaced by a requeue) gives way to a
        done one that holds nothing (a cancelled one), so that ticket, future and attempt do not hold
        each other in a cycle that only a full pass of the garbage collector frees."""
        fut = self.future
        if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is attempt:
            self.future = fut.get_loop().create_future()
            self.future.cancel()


class Requeued(StrEnum):
    """Why an attempt ended without output and its ticket went back to the proxy queue."""

    TAKEN_BACK = "taken_back"  # the controller took it back from a worker it drains
    RETRY = "retry"  # the worker failed before any output (one of the request's attempts spent)
    UNREACHABLE = "unreachable"  # the worker refused the connection (no attempt spent: it never saw it)
    LOST = "lost"  # the worker of a started stream broke; the answer goes on from its text on the next worker


class Attempt:
    """One try of one request on one worker, from dispatch until its ``async with`` block exits."""

    __slots__ = (
        "dispatched_at",
        "going_on_from",
        "on_take_back",
        "released",
        "requeued",
        "sent_max_tokens",
        "started",
        "streamed",
        "taken_back",
        "task",
        "ticket",
        "worker_id",
    )

    def __init__(self, ticket: Ticket, worker_id: WorkerId, dispatched_at: float) -> None:
        self.ticket = ticket
        self.worker_id = worker_id
        self.dispatched_at = dispatched_at
        self.task: asyncio.Task[object] | None = None  # the handler that owns it, until its first output
        self.started = False  # output went to the client: it can no longer be taken back nor retried
        self.streamed = False  # a stream: ``started`` comes with its first token (a whole answer's, with its end)
        self.taken_back = False
        self.released = False
        self.requeued: Requeued | None = None  # set when it ended without output and its ticket went back
        # the max_tokens the worker was asked for (its output budget; None: as asked)
        self.sent_max_tokens: int | None = None
        # set while the relay reads a whole answer the worker can end early and still give (what it wrote):
        # a take-back calls it instead of cancelling the block, and the block ends with :class:`TakenBack`
        self.on_take_back: Callable[[], None] | None = None
        # the output tokens an earlier attempt wrote (taken back, kept) that this one goes on from: its
        # worker prefills them as prompt and writes only the rest
        self.going_on_from = 0

    def mark_started(self) -> None:
        """Output is going to the client: from now on the request is committed to this worker."""
        self.started = True
        self.task = None


class TakenBack(Exception):
    """An attempt taken back from its worker ended with what the worker had written (kept on its
    ticket): raised inside its ``async with`` block, which puts the ticket back in the queue."""


class WorkerLost(Exception):
    """The worker of a stream that had started broke, and the answer can go on from the text the
    client has (a plain request): raised inside its ``async with`` block, which puts the ticket back
    in the queue, away from that worker when another one serves. ``resume`` is the relay's state of
    the stream (its client response, the text so far), which the next attempt goes on with."""

    def __init__(self, resume: object) -> None:
        super().__init__("the worker broke mid-stream; the answer goes on elsewhere")
        self.resume = resume


class AttemptFailed(Exception):
    """An attempt failed before any output reached the client (raised inside its ``async with``).

    ``retryable``: another attempt may succeed (a 5xx, a reset, a stream that ended before output);
    ``unreachable``: the worker refused the connection, so it never saw the request; ``gone``: its
    connection broke and the worker refuses new ones (it died: wait for a live one). ``body`` and
    ``content_type`` keep a worker's own error answer, relayed as is when no retry is left.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        retryable: bool = True,
        unreachable: bool = False,
        gone: bool = False,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.unreachable = unreachable
        self.gone = gone
        self.body = body
        self.content_type = content_type
