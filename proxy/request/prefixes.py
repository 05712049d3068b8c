"""Which prompt prefixes are on the workers and which wait in the proxy's queue.

SGLang's ``lpm`` serves first the waiting requests whose prefix its radix cache holds, but it sorts
only the requests waiting at the engine, and past 128 of them it falls back to arrival order. The
proxy holds the rest of a backlog. So the proxy's queue does what ``lpm`` would do over all of it: a
request whose prefix (its ticket's ``affinity``) is on a worker now goes before older ones, since
that worker likely still caches it. No request is passed over by more later ones than the engine's
own limit (:class:`~proxy.request.admission.AdmissionQueue`'s ``prefix_first``). A prefix is *ready*
when requests with it run on a worker, one of them has answered since they began (so the worker
computed it: requests sent together before that would each compute it again), and another waits here.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["Prefixes"]


class Prefixes:
    """Counts of each prefix on the workers and waiting, and the ready ones."""

    __slots__ = ("_answered", "_on_workers", "_waiting", "ready")

    def __init__(self) -> None:
        self._on_workers: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._answered: set[str] = set()  # one of the requests on the workers with it has answered
        self.ready: set[str] = set()

    def waiting(self, prefix: str, change: int) -> None:
        """``change`` requests with ``prefix`` joined (+) or left (-) the queue."""
        self._move(self._waiting, prefix, change)

    def on_workers(self, prefix: str, change: int, *, answered: bool = False) -> None:
        """``change`` requests with ``prefix`` started (+) or ended (-) on a worker, ``answered`` or not."""
        if answered and self._on_workers[prefix] + change > 0:
            self._answered.add(prefix)
        self._move(self._on_workers, prefix, change)

    def any_shared(self) -> bool:
        """Whether two requests the proxy holds (waiting here or on a worker) carry the same prefix."""
        on = self._on_workers
        return any(n + on[p] > 1 for p, n in self._waiting.items()) or any(n > 1 for n in on.values())

    def clear_waiting(self) -> None:
        self._waiting.clear()
        self.ready.clear()

    def _move(self, counts: Counter[str], prefix: str, change: int) -> None:
        left = counts[prefix] + change
        if left > 0:
            counts[prefix] = left
        else:
            counts.pop(prefix, None)  # a prefix no request holds is forgotten: the counts stay as small as the work
        if not self._on_workers[prefix]:
            self._answered.discard(prefix)  # no request holds it on a worker: it may be evicted there
        if prefix in self._answered and self._waiting[prefix] > 0:
            self.ready.add(prefix)
        else:
            self.ready.discard(prefix)
