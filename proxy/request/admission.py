"""The proxy's own queue: what waits here is not yet on any worker.

Priority classes are strict: a ``batch`` ticket is handed out only while no ``interactive`` ticket
waits. Within a class the order is FIFO; a ticket taken back from a worker (a retry, or a request
the controller requeues before it produced output) goes to the *front* of its class so that it does
not lose its place.

Every operation is O(1) amortised. A cancelled ticket (client gone, deadline passed) is only
marked; it is skipped when it reaches the head, and the deques are compacted when dead entries
outnumber live ones, so a long outage with many timeouts cannot grow memory without bound.

The queue never sleeps and never answers a client: it hands tickets to the dispatcher
(:meth:`AdmissionQueue.pop`) and the request handler that owns a ticket awaits
:attr:`Ticket.future`, which the dispatcher resolves with the chosen worker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.policy import Priority
from proxy.request.attempt import Ticket

__all__ = ["ORDER", "AdmissionQueue", "Priority", "QueueFull"]

ORDER: tuple[Priority, ...] = (Priority.INTERACTIVE, Priority.BATCH)


class QueueFull(Exception):
    """The queue holds ``capacity`` tickets already (the client gets 429 + Retry-After)."""


class AdmissionQueue:
    """Bounded, two-class, FIFO-within-class queue of :class:`Ticket`."""

    def __init__(self, capacity: int, *, on_change: Callable[[], Any] | None = None, compact_slack: int = 1024) -> None:
        if capacity < 0:
            raise ValueError("queue capacity must be >= 0")
        self.capacity = capacity
        self._q: dict[Priority, deque[Ticket]] = {p: deque() for p in ORDER}
        self._live: dict[Priority, int] = {p: 0 for p in ORDER}
        self._dead = 0
        self._on_change = on_change
        self._compact_slack = compact_slack

    # -- sizes ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._live[Priority.INTERACTIVE] + self._live[Priority.BATCH]

    def depth(self, priority: Priority) -> int:
        return self._live[priority]

    # -- mutation ---------------------------------------------------------------------------------
    def push(self, ticket: Ticket) -> None:
        """Admit a new ticket at the back of its class; raises :class:`QueueFull` past capacity."""
        if len(self) >= self.capacity:
            raise QueueFull(f"the proxy queue is full ({self.capacity} requests waiting)")
        self._q[ticket.priority].append(ticket)
        self._enqueued(ticket)

    def requeue(self, ticket: Ticket) -> None:
        """Put a ticket that already held a place back at the *front* of its class.

        Not bounded by capacity: the request was accepted once and must not be dropped now.
        """
        if ticket.queued or ticket.cancelled:
            return
        ticket.requeues += 1
        if ticket.future.done():
            ticket.future = asyncio.get_running_loop().create_future()
        self._q[ticket.priority].appendleft(ticket)
        self._enqueued(ticket)

    def peek(self) -> Ticket | None:
        """The next ticket to dispatch (interactive first), without removing it."""
        for p in ORDER:
            q = self._q[p]
            while q:
                head = q[0]
                if head.queued:
                    return head
                q.popleft()
                self._dead -= 1
        return None

    def pop(self) -> Ticket | None:
        head = self.peek()
        if head is not None:
            self._q[head.priority].popleft()
            head.queued = False
            self._live[head.priority] -= 1
        return head

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a waiting ticket (client gone or deadline passed). True if it was queued."""
        ticket.cancelled = True
        if not ticket.queued:
            return False
        ticket.queued = False
        self._live[ticket.priority] -= 1
        self._dead += 1
        if self._dead > len(self) + self._compact_slack:
            self._compact()
        return True

    def drain_all(self) -> list[Ticket]:
        """Remove and return every live ticket (shutdown)."""
        out = [t for p in ORDER for t in self._q[p] if t.queued]
        for t in out:
            t.queued = False
        for p in ORDER:
            self._q[p].clear()
            self._live[p] = 0
        self._dead = 0
        return out

    # -- internals --------------------------------------------------------------------------------
    def _enqueued(self, ticket: Ticket) -> None:
        ticket.queued = True
        self._live[ticket.priority] += 1
        if self._on_change is not None:
            self._on_change()

    def _compact(self) -> None:
        for p in ORDER:
            self._q[p] = deque(t for t in self._q[p] if t.queued)
        self._dead = 0
