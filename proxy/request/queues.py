"""The proxy's queue as a whole when each pool has its own (:class:`QueueTotals`), read the way one
:class:`~proxy.request.admission.AdmissionQueue` is read (its length and depth per class): the
metrics, the status line and the admin view count every pool's waiting requests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from proxy.request.admission import ORDER, AdmissionQueue, KeyStats, Priority
from proxy.request.attempt import Ticket

__all__ = ["QueueDepth", "QueueTotals"]


class QueueDepth(Protocol):
    def __len__(self) -> int: ...

    def depth(self, priority: Priority) -> int: ...

    def drain_all(self) -> list[Ticket]: ...

    def stats(self) -> Iterator[tuple[Priority, str, KeyStats]]: ...

    @property
    def sent_ahead(self) -> int: ...


class QueueTotals:
    """Sums over the pools' admission queues (each still the one truth of its own tickets)."""

    def __init__(self, queues: Sequence[AdmissionQueue]) -> None:
        self.queues = tuple(queues)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def depth(self, priority: Priority) -> int:
        return sum(q.depth(priority) for q in self.queues)

    def drain_all(self) -> list[Ticket]:
        return [t for q in self.queues for t in q.drain_all()]

    @property
    def sent_ahead(self) -> int:
        return sum(q.sent_ahead for q in self.queues)

    def stats(self) -> Iterator[tuple[Priority, str, KeyStats]]:
        """Each (class, key)'s figures summed over the pools."""
        total: dict[tuple[Priority, str], KeyStats] = {}
        for q in self.queues:
            for p, key, st in q.stats():
                t = total.setdefault((p, key), KeyStats())
                t.waiting += st.waiting
                t.dispatched += st.dispatched
                t.dispatched_tokens += st.dispatched_tokens
                t.wait_s += st.wait_s
        for (p, key), st in sorted(total.items(), key=lambda kv: (ORDER.index(kv[0][0]), kv[0][1])):
            yield p, key, st
