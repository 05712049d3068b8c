"""The proxy's own queue: what waits here is not yet on any worker.

- **Classes.** Interactive first; while both wait, batch gets ``batch_floor`` of the dispatches (a
  credit, not banked while batch has nothing waiting), so it is never starved.
- **Keys.** Deficit round robin by estimated *tokens* within a class (:func:`estimate_cost`): two
  backlogged keys get tokens in proportion to their weights, whatever their request sizes. A key
  not in the ring goes first, as fq_codel's new flows, then joins the ring's back and leaves only
  when its turn comes with nothing waiting: a light key waits for no backlogged key's turn.
- **Order.** FIFO within a key. A ticket taken back from a worker goes to the front of its key, and
  its key to the front of the ring, cost refunded: it loses neither its place nor its share. Where the
  pool's engine sorts by prefix (``prefix_first``: SGLang's ``lpm`` limit), a ticket whose prefix is
  ready goes before older ones of its key, and the key's oldest is passed over at most
  ``prefix_first`` times in a row (:mod:`proxy.request.prefixes`).
- **Full.** At capacity, a key holding fewer waiting tickets than the key holding the most pushes
  out that key's newest ticket of its class or a lower one (never interactive work for batch); the
  key holding the most gets the 429 itself. One key flooding the queue cannot lock the others out.

Operations are O(1) amortised (a push at capacity looks at every key waiting). A cancelled ticket
is only marked and skipped at the head; the deques are compacted when dead entries outnumber live
ones, so memory stays bounded. The queue never sleeps and never answers a client: the dispatcher
pops tickets and resolves :attr:`Ticket.future` with the chosen worker. Per class and key it keeps
what ``/metrics`` shows: waiting, dispatched requests and tokens, time waited.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.policy import Priority
from proxy.request.attempt import Ticket
from proxy.request.prefixes import Prefixes

__all__ = ["BYTES_PER_TOKEN", "ORDER", "AdmissionQueue", "KeyStats", "Priority", "QueueFull", "estimate_cost"]

ORDER: tuple[Priority, ...] = (Priority.INTERACTIVE, Priority.BATCH)
DEFAULT_QUANTUM = 4096  # tokens of credit per turn of a key of weight 1
BYTES_PER_TOKEN = 4  # a prompt's tokens, estimated from its body when no tokenizer is at hand


MAX_COMPLETION_ESTIMATE = 1 << 20  # beyond any model's context: a larger max_tokens is refused by the engine


def estimate_cost(body_bytes: int, max_tokens: int | None, default_max_tokens: int, n: int = 1) -> int:
    """A request's estimated tokens: its prompt (body bytes / 4) plus ``n`` completions of
    ``max_tokens`` (``default_max_tokens`` when not given), each at most
    :data:`MAX_COMPLETION_ESTIMATE`: a ``max_tokens`` of 10^11 would otherwise wait ~10^7 turns of
    the round robin (holding its key's later requests behind it) instead of reaching the engine,
    which answers that it exceeds the context."""
    completion = default_max_tokens if max_tokens is None else min(max(0, max_tokens), MAX_COMPLETION_ESTIMATE)
    return max(1, body_bytes // BYTES_PER_TOKEN + max(1, n) * completion)


class QueueFull(Exception):
    """The queue holds ``capacity`` tickets already (the client gets 429 + Retry-After)."""


@dataclass(slots=True)
class KeyStats:
    """What one key did in one class since start (read by ``/metrics``)."""

    waiting: int = 0
    dispatched: int = 0
    dispatched_tokens: int = 0
    wait_s: float = 0.0  # total time its dispatched tickets waited


class _Class:
    """One priority class: a deque per key, the new keys and the ring of keys with waiting tickets."""

    __slots__ = ("by_prefix", "deficit", "fresh", "live", "passed", "queues", "ring", "stats")

    def __init__(self) -> None:
        self.queues: dict[str, deque[Ticket]] = {}
        self.by_prefix: dict[str, dict[str, deque[Ticket]]] = {}  # per key, its tickets per prefix, in order
        self.passed: dict[str, int] = {}  # per key, the picks that passed over its oldest ticket
        self.fresh: deque[str] = deque()  # keys that had nothing waiting: served before the ring
        self.ring: deque[str] = deque()  # backlogged keys with a live ticket; the head has the turn
        self.deficit: dict[str, float] = {}
        self.live = 0
        self.stats: dict[str, KeyStats] = {}


class AdmissionQueue:
    """Bounded queue of :class:`Ticket`: two classes, a batch floor, deficit round robin by tokens."""

    def __init__(
        self,
        capacity: int,
        *,
        on_change: Callable[[], Any] | None = None,
        compact_slack: int = 1024,
        weights: Mapping[str, float] | None = None,
        batch_floor: float = 0.05,
        quantum: int = DEFAULT_QUANTUM,
        prefix_first: int = 0,
    ) -> None:
        if capacity < 0:
            raise ValueError("queue capacity must be >= 0")
        if not 0.0 <= batch_floor <= 1.0:
            raise ValueError("batch_floor must be within [0, 1]")
        self.capacity = capacity
        self.batch_floor = batch_floor
        self.quantum = max(1, quantum)
        self._weights = dict(weights or {})
        self._classes: dict[Priority, _Class] = {p: _Class() for p in ORDER}
        self._dead = 0
        self._floor_credit = 0.0
        self._on_change = on_change
        self._compact_slack = compact_slack
        self._picked: Ticket | None = None
        self.prefix_first = max(0, prefix_first)  # 0: FIFO within a key
        self.prefixes = Prefixes()
        self._pushed = 0  # the orders given: each push the next up, each requeue the next down
        self.sent_ahead = 0  # tickets given out before older ones of their key, their prefix ready
        self._requeued = 0

    # -- sizes ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(c.live for c in self._classes.values())

    def depth(self, priority: Priority) -> int:
        return self._classes[priority].live

    def held(self) -> int:
        """Entries the deques hold, live or cancelled-but-not-yet-dropped (memory)."""
        held = sum(len(q) for c in self._classes.values() for q in c.queues.values())
        return held + sum(len(q) for c in self._classes.values() for g in c.by_prefix.values() for q in g.values())

    def stats(self) -> Iterator[tuple[Priority, str, KeyStats]]:
        """(class, key, its figures) for every key seen in every class."""
        for p in ORDER:
            for key, st in self._classes[p].stats.items():
                yield p, key, st

    def weight(self, key: str) -> float:
        return self._weights.get(key, 1.0)

    # -- mutation ---------------------------------------------------------------------------------
    def push(self, ticket: Ticket) -> Ticket | None:
        """Admit a new ticket at the back of its key. At capacity it pushes out the newest ticket of
        the key holding the most, and returns it (withdrawn: its owner must be told), when that key
        holds more than this one will; otherwise raises :class:`QueueFull`."""
        pushed_out = None
        if len(self) >= self.capacity:
            pushed_out = self._longest_newest(ticket)
            if pushed_out is None:
                raise QueueFull(f"the proxy queue is full ({self.capacity} requests waiting)")
            self.cancel(pushed_out)
        c = self._classes[ticket.priority]
        c.queues.setdefault(ticket.key, deque()).append(ticket)
        self._pushed += 1
        ticket.order = self._pushed
        self._index(c, ticket, front=False)
        if ticket.key not in c.deficit:
            c.deficit[ticket.key] = self._quantum(ticket.key)  # a new key's one quantum, before the ring
            c.fresh.append(ticket.key)
        self._enqueued(ticket)
        return pushed_out

    def requeue(self, ticket: Ticket) -> None:
        """Put a ticket that already held a place back at the *front* of its key, its key at the
        front of the ring (its turn next, after the new keys' first requests; a turn it had, kept) or
        of the new keys, and its cost back in its credit: it loses neither its place nor its share.

        Not bounded by capacity: the request was accepted once and must not be dropped now.
        """
        if ticket.queued or ticket.cancelled:
            return
        ticket.requeues += 1
        if ticket.future.done():
            ticket.future = asyncio.get_running_loop().create_future()
        c = self._classes[ticket.priority]
        c.queues.setdefault(ticket.key, deque()).appendleft(ticket)
        self._requeued -= 1
        ticket.order = self._requeued
        self._index(c, ticket, front=True)
        if ticket.key in c.fresh:  # a new key: first among the new ones
            c.fresh.remove(ticket.key)
            c.fresh.appendleft(ticket.key)
        elif ticket.key in c.deficit:  # in the ring: at its front, the turn its own (kept, if it had it)
            c.ring.remove(ticket.key)
            c.ring.appendleft(ticket.key)
        else:  # it had nothing else waiting: first among the new keys
            c.fresh.appendleft(ticket.key)
        c.deficit[ticket.key] = c.deficit.get(ticket.key, 0.0) + ticket.cost
        self._picked = None
        self._enqueued(ticket)

    def peek(self, only: Priority | None = None) -> Ticket | None:
        """The next ticket to dispatch, without removing it (the same one until a push, pop or requeue).

        ``only``: the next ticket of that class (None if none waits), leaving the pick as it was;
        ``pop(only)`` takes it. The dispatcher asks for the interactive class when the batch's floor
        turn came but the batch's own gates hold it: interactive work does not wait behind a batch
        ticket that cannot go, and the batch keeps its turn (the pick and the credit stay)."""
        if only is not None:
            c = self._classes[only]
            return self._drr_head(c) if c.live else None
        if self._picked is not None and self._picked.queued:
            return self._picked
        interactive, batch = (self._classes[p] for p in ORDER)
        if interactive.live and batch.live and self._floor_credit >= 1.0:
            chosen = batch
        elif interactive.live:
            chosen = interactive
        elif batch.live:
            chosen = batch
        else:
            return None
        self._picked = self._drr_head(chosen)
        return self._picked

    def pop(self, only: Priority | None = None) -> Ticket | None:
        """Take the ticket :meth:`peek` shows (of class ``only``, when given) out of the queue."""
        head = self.peek(only)
        if head is None:
            return None
        if only is None or head is self._picked:
            self._picked = None
        c = self._classes[head.priority]
        both = self._classes[Priority.INTERACTIVE].live and self._classes[Priority.BATCH].live
        line = c.queues[head.key]
        if line[0] is head:
            line.popleft()
            c.passed.pop(head.key, None)
        else:  # a ticket whose prefix is on a worker, before older ones
            line.remove(head)
            c.passed[head.key] = c.passed.get(head.key, 0) + 1
            self.sent_ahead += 1
        self._unindex(c, head)
        head.queued = False
        c.live -= 1
        c.deficit[head.key] -= head.cost
        c.stats.setdefault(head.key, KeyStats()).waiting -= 1
        if c.fresh and c.fresh[0] == head.key:
            # a new key sent its first: it joins the ring's back, emptied or not (it retires when its
            # turn comes with nothing waiting), so keeping one request waiting cannot make every
            # request new (fq_codel's rule); its new turn's leftover credit is not carried there
            c.fresh.popleft()
            c.ring.append(head.key)
            c.deficit[head.key] = 0.0
        elif self._head_of(c, head.key) is None:
            self._retire(c, head.key)
        if head.priority is Priority.BATCH and self._floor_credit >= 1.0:
            self._floor_credit -= 1.0
        if both:
            self._floor_credit += self.batch_floor
        elif not self._classes[Priority.BATCH].live:
            self._floor_credit = 0.0  # nothing of batch waits: its floor is not banked
        return head

    def record_dispatch(self, ticket: Ticket, waited_s: float) -> None:
        """The dispatcher's note that a ticket it popped went to a worker, and how long it waited (for
        ``/metrics``; a popped ticket whose client had left meanwhile is not dispatched)."""
        st = self._classes[ticket.priority].stats.setdefault(ticket.key, KeyStats())
        st.dispatched += 1
        st.dispatched_tokens += ticket.cost
        st.wait_s += waited_s

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a waiting ticket (client gone or deadline passed). True if it was queued."""
        ticket.cancelled = True
        if not ticket.queued:
            return False
        ticket.queued = False
        c = self._classes[ticket.priority]
        c.live -= 1
        c.stats[ticket.key].waiting -= 1
        if self._picked is ticket:
            self._picked = None
        self._dead += 1
        if (prefix := self._prefix_of(ticket)) is not None:
            self._dead += 1  # its entry in its prefix's line too
            self.prefixes.waiting(prefix, -1)
        if self._head_of(c, ticket.key) is None:
            self._retire(c, ticket.key)
        if self._dead > len(self) + self._compact_slack:
            self._compact()
        return True

    def drain_all(self) -> list[Ticket]:
        """Remove and return every live ticket (shutdown)."""
        out = [t for c in self._classes.values() for q in c.queues.values() for t in q if t.queued]
        for t in out:
            t.queued = False
        for c in self._classes.values():
            c.queues.clear()
            c.by_prefix.clear()
            c.passed.clear()
            c.fresh.clear()
            c.ring.clear()
            c.deficit.clear()
            c.live = 0
            for st in c.stats.values():
                st.waiting = 0
        self._dead = 0
        self._picked = None
        self._floor_credit = 0.0
        self.prefixes.clear_waiting()
        return out

    def on_worker(self, ticket: Ticket, change: int, *, answered: bool = False) -> None:
        """``ticket``'s request started (+1) or ended (-1, ``answered`` or not) on a worker: its prefix's
        waiting tickets go first while it is ready (:mod:`proxy.request.prefixes`)."""
        if (prefix := self._prefix_of(ticket)) is not None:
            self.prefixes.on_workers(prefix, change, answered=answered)
            self._picked = None  # a prefix may have become ready, or stopped being: pick again

    # -- internals --------------------------------------------------------------------------------
    def _drr_head(self, c: _Class) -> Ticket:
        """Deficit round robin: a new key first when its quantum covers its head ticket, then the
        ring's head key while its credit covers its head ticket's cost."""
        while c.fresh:
            key = c.fresh[0]
            head = self._pick_of(c, key)
            if head is None:  # only cancelled tickets were left
                self._retire(c, key)
            elif c.deficit[key] >= head.cost:
                return head
            else:  # a ticket beyond its quantum: it waits for its turns in the ring, its credit kept
                c.fresh.popleft()
                c.ring.append(key)
        while True:
            key = c.ring[0]
            head = self._pick_of(c, key)
            if head is None:  # only cancelled tickets were left
                self._retire(c, key)
                continue
            if c.deficit[key] >= head.cost:
                return head
            if c.deficit[key] >= 0.0 and len(c.ring) > 1:
                c.ring.rotate(-1)  # its turn is over; the next key gets its quantum
                c.deficit[c.ring[0]] += self._quantum(c.ring[0])
            else:  # alone, or fresh in the ring: credit until it covers the head
                need = head.cost - c.deficit[key]
                step = self._quantum(key)
                c.deficit[key] += step * max(1, -(-need // step))

    def _quantum(self, key: str) -> float:
        return self.quantum * self.weight(key)

    def _head_of(self, c: _Class, key: str) -> Ticket | None:
        """The key's first live ticket (cancelled ones before it are dropped)."""
        q = c.queues.get(key)
        return self._live_head(q) if q else None

    def _pick_of(self, c: _Class, key: str) -> Ticket | None:
        """The key's next ticket: its oldest waiting whose prefix is ready, unless its oldest of all
        (the head) was passed over ``prefix_first`` times already or was taken back; else the head."""
        head = self._head_of(c, key)
        ready = self.prefixes.ready
        groups = c.by_prefix.get(key)
        if head is None or not ready or not groups or head.requeues or head.affinity in ready:
            return head
        if c.passed.get(key, 0) >= self.prefix_first:
            return head
        best: Ticket | None = None
        for prefix in ready if len(ready) <= len(groups) else list(groups):
            line = groups.get(prefix)
            if line is None or prefix not in ready:
                continue
            first = self._live_head(line)
            if first is None:
                del groups[prefix]
            elif best is None or first.order < best.order:
                best = first
        return best or head

    def _live_head(self, line: deque[Ticket]) -> Ticket | None:
        """The first live ticket of a key's or a prefix's line (cancelled ones before it are dropped)."""
        while line:
            if line[0].queued:
                return line[0]
            line.popleft()
            self._dead -= 1
        return None

    def _prefix_of(self, ticket: Ticket) -> str | None:
        """The prefix a ticket is filed under (None: it has none, or the queue keeps arrival order)."""
        return ticket.affinity if self.prefix_first else None

    def _index(self, c: _Class, ticket: Ticket, *, front: bool) -> None:
        """File a ticket under its prefix too (before ``queued`` is set: a push or requeue)."""
        if (prefix := self._prefix_of(ticket)) is None:
            return
        line = c.by_prefix.setdefault(ticket.key, {}).setdefault(prefix, deque())
        line.appendleft(ticket) if front else line.append(ticket)
        self.prefixes.waiting(prefix, 1)

    def _unindex(self, c: _Class, ticket: Ticket) -> None:
        """Take a ticket leaving for a worker out of its prefix's line (while it is still ``queued``)."""
        if (prefix := self._prefix_of(ticket)) is None:
            return
        groups = c.by_prefix.get(ticket.key, {})
        line = groups.get(prefix)
        if line is not None:
            if self._live_head(line) is ticket:
                line.popleft()
            else:  # not first in its line: cannot happen while both lines keep the key's order
                line.remove(ticket)
            if not line:
                del groups[prefix]
            if not groups:
                c.by_prefix.pop(ticket.key, None)
        self.prefixes.waiting(prefix, -1)

    def _retire(self, c: _Class, key: str) -> None:
        """A key with nothing left waiting leaves the new keys or the ring and forgets its credit;
        when it had the ring's turn, the turn passes to the next key."""
        if key in c.fresh:
            c.fresh.remove(key)
        else:
            had_turn = c.ring[0] == key
            c.ring.remove(key)
            if had_turn and c.ring:
                c.deficit[c.ring[0]] += self._quantum(c.ring[0])
        del c.deficit[key]
        c.passed.pop(key, None)
        q = c.queues.pop(key, None)
        if q:
            self._dead -= sum(1 for t in q if not t.queued)
        for line in c.by_prefix.pop(key, {}).values():
            self._dead -= sum(1 for t in line if not t.queued)

    def _longest_newest(self, arriving: Ticket) -> Ticket | None:
        """The ticket a full queue drops for ``arriving``: the newest first-time ticket of the key
        holding the most waiting that has one, of ``arriving``'s class or a lower one (batch
        first), when that key holds more than ``arriving``'s will with it (None: none such).
        Looks at the keys with something queued only."""
        held: dict[str, int] = {}
        for c in self._classes.values():
            for k in c.queues:
                held[k] = held.get(k, 0) + c.stats[k].waiting
        mine = held.get(arriving.key, 0) + 1
        classes = [p for p in reversed(ORDER) if p is arriving.priority or p is Priority.BATCH]
        for k in sorted(held, key=held.__getitem__, reverse=True):
            if held[k] <= mine:
                return None
            if k == arriving.key:
                continue
            for p in classes:
                for t in reversed(self._classes[p].queues.get(k, ())):
                    if t.queued and t.requeues == 0:
                        return t
        return None

    def _enqueued(self, ticket: Ticket) -> None:
        ticket.queued = True
        c = self._classes[ticket.priority]
        c.live += 1
        c.stats.setdefault(ticket.key, KeyStats()).waiting += 1
        if self._picked is not None and ticket.priority is Priority.INTERACTIVE:
            self._picked = None  # an interactive arrival may go before a picked batch ticket
        if self._on_change is not None:
            self._on_change()

    def _compact(self) -> None:
        for c in self._classes.values():
            for key in list(c.queues):
                c.queues[key] = deque(t for t in c.queues[key] if t.queued)
            for key, groups in list(c.by_prefix.items()):
                kept = {p: deque(t for t in line if t.queued) for p, line in groups.items()}
                c.by_prefix[key] = {p: line for p, line in kept.items() if line}
        self._dead = 0
