"""The proxy's queue order over a replay's requests, where the engine sorts by prefix.

The proxy's queue sends first a waiting request whose prefix is ready (requests with it run on the
worker, one of them answered since they began), before older ones, the oldest passed over at most
``limit`` times in a row (``AdmissionQueue``'s ``prefix_first``, ``proxy.request.prefixes``). A
replay in front of one engine (the planner's twin, the scenarios' sweep) sends in the same order, so
what it predicts for ``lpm`` is what the proxy gets.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable

from proxy.sim.request import RequestSpec

__all__ = ["PREFIX_TOKENS", "PrefixFirst", "prefix_group"]

PREFIX_TOKENS = 64  # the proxy keys a prompt's prefix on its first 256 characters: about 64 tokens


def prefix_group(spec: RequestSpec) -> Hashable | None:
    """The prefix the proxy would key ``spec`` on: its shared head's group, else its first tokens."""
    if spec.shared is not None:
        return spec.shared[0]
    return tuple(spec.prompt_ids[:PREFIX_TOKENS]) if spec.prompt_ids else None


def _no_group(index: int) -> None:
    return None


class PrefixFirst:
    """Requests (by index) waiting in the proxy, in their order, filed by prefix group."""

    def __init__(self, group: Callable[[int], Hashable | None], limit: int) -> None:
        self._group = group if limit > 0 else _no_group  # arrival order: no request needs its group
        self._limit = limit
        self._line: deque[int] = deque()
        self._by_group: dict[Hashable, deque[int]] = {}
        self._place: dict[int, int] = {}  # waiting index -> its place (lower goes first)
        self._taken_back: set[int] = set()
        self._running: Counter[Hashable] = Counter()
        self._answered: set[Hashable] = set()  # groups running on the worker, one of them answered since
        self._ready: set[Hashable] = set()  # answered groups with requests waiting here
        self._next = self._back = 0
        self._passed = 0

    def __len__(self) -> int:
        return len(self._place)

    def head(self) -> int | None:
        """The oldest waiting request (None: none)."""
        while self._line and self._line[0] not in self._place:
            self._line.popleft()
        return self._line[0] if self._line else None

    def add(self, indices: Iterable[int], *, front: bool = False) -> None:
        """Requests join at the back, in order; or (``front``: taken back from the worker) at the front."""
        items = list(indices)
        for i in reversed(items) if front else items:
            if front:
                self._back -= 1
                self._place[i] = self._back
                self._taken_back.add(i)
                self._line.appendleft(i)
            else:
                self._next += 1
                self._place[i] = self._next
                self._line.append(i)
            g = self._group(i)
            if g is not None:
                line = self._by_group.setdefault(g, deque())
                line.appendleft(i) if front else line.append(i)
                if g in self._answered:
                    self._ready.add(g)

    def take(self, arrived: Callable[[int], bool]) -> int:
        """The next request to send (the head must have ``arrived``), marked running on the worker."""
        head = self.head()
        assert head is not None and arrived(head)
        pick = head
        if self._ready and self._passed < self._limit and head not in self._taken_back:
            g = self._group(head)
            if g is None or g not in self._ready:
                pick = self._oldest_ready(arrived) or head
        self._passed = 0 if pick == head else self._passed + 1
        del self._place[pick]
        self._taken_back.discard(pick)
        g = self._group(pick)
        if g is not None:
            line = self._by_group[g]
            line.popleft() if line[0] == pick else line.remove(pick)
            if not line:
                del self._by_group[g]
            self._running[g] += 1
            if g not in self._by_group:
                self._ready.discard(g)
        return pick

    def ended(self, index: int, *, answered: bool) -> None:
        """A request sent is done on the worker: ``answered``, or not (taken back, refused)."""
        g = self._group(index)
        if g is None or self._running[g] <= 0:
            return
        self._running[g] -= 1
        if not self._running[g]:
            del self._running[g]
            self._answered.discard(g)
            self._ready.discard(g)
        elif answered:
            self._answered.add(g)
            if g in self._by_group:
                self._ready.add(g)

    def _oldest_ready(self, arrived: Callable[[int], bool]) -> int | None:
        best: int | None = None
        for g in self._ready:
            first = self._by_group[g][0]
            if arrived(first) and (best is None or self._place[first] < self._place[best]):
                best = first
        return best
