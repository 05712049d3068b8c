"""Per-worker load as the proxy knows it: its own in-flight count plus the latest scraped sample.

One :class:`WorkerLoad` per worker lives in a :class:`LoadBoard`, shared by the dispatcher (which
reserves and releases), the scraper (which records samples and errors), the status log, the admin
API and the rollout (which waits for a worker to empty).

What is in flight on a worker is one fact: its open attempts, in the order they were sent
(:attr:`WorkerLoad.attempts`, added by :meth:`WorkerLoad.reserve` and removed by
:meth:`WorkerLoad.release`); ``in_flight`` is its length. Whether a worker may get new requests
is not kept here: it is the pool's :class:`~proxy.workers.base.WorkerState` (READY or not).

Estimated server-side queue (what the pacing gate compares with the band)::

    est_queue = max(0, q_s + (D - D_s) - (C - C_s),      # the scrape, moved forward by our own events
                       in_flight - r_s)                  # what we have open there, minus what runs

``q_s``/``r_s`` are ``#queue-req``/``#running-req`` of the latest sample; ``D``/``C`` count requests
this proxy dispatched to / saw finish on the worker. ``D_s`` is taken when the scrape was *sent* and
``C_s`` when its answer *arrived*, so whatever happened while the scrape was on the wire errs high.
A request sent since the scrape lands in the server's waiting queue; a request that finishes frees
a running slot that the server refills from its queue.

The first term alone undercounts when completions reach the proxy after the server already
refilled the slots (q_s then shows a momentarily short queue and the same completions are
subtracted again); an engine that finishes whole batches at once makes that common. The second
term bounds it: everything this proxy has open on the worker is either running or waiting there
(or on the wire), so ``in_flight - r_s`` waits. It errs high while a worker fills up (``r_s`` is
low until the next scrape) and ignores other clients of the worker, which the first term sees.
Both err high rather than low, so the band's upper edge holds; the next scrape corrects the rest.

Values the fast tier (``proxy.control.fast_tier``) sets after each scrape, held here only:
``limit`` (None: no limit), counted per class: a batch request goes while everything in flight on
the worker is under it, an interactive one while the interactive requests in flight are, so no
interactive request waits in the proxy for a batch request to end; ``queue_target`` (the gate's
target for ``est_queue`` on this worker, capped by the band's ``hi``; None: the band's own target);
and ``batch_queue_target`` (the batch class's target while interactive work is on the worker:
None: ``queue_target``).

A sample older than ``stale_after_s`` (or none yet, or the last scrape failed) makes the worker
count as saturated. When every ready worker is saturated for that reason alone, the dispatcher
falls back to its own counts: ``in_flight < last_running + band_hi`` (``last_running`` 0 if the
worker was never scraped), so a proxy whose scrapes fail keeps serving at a bounded depth.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from proxy.engines.base import Sample, output_rate
from proxy.request.attempt import Attempt
from proxy.request.budgets import OutputBudgets
from proxy.request.facts import WorkerFacts
from proxy.workers.base import WorkerId

SampleObserver = Callable[[WorkerId, "Sample | None", "str | None"], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Band:
    """The policy's queue band and headroom: dispatch while ``est_queue < target``, never past ``hi``.

    ``target = min(lo + headroom, hi)``, but at least 1: a band of ``[0, 0]`` still lets one request
    wait at a worker at a time (the estimate counts a just-sent request as queued until a scrape
    shows it running).
    """

    lo: int
    hi: int
    headroom: int = 0

    @property
    def target(self) -> int:
        return max(1, min(self.lo + self.headroom, self.hi))


class WorkerLoad:
    """What the proxy knows about one worker's load right now."""

    __slots__ = (
        "_base_completed",
        "_base_dispatched",
        "_idle",
        "_pending_base",
        "attempts",
        "batch_attempts",
        "batch_limit",
        "batch_paced_until",
        "batch_queue_target",
        "completed",
        "dispatched",
        "error",
        "facts",
        "first_token_wait_s",
        "last_running",
        "limit",
        "output_budgets",
        "output_rate",
        "queue_target",
        "sample",
        "worker_id",
    )

    def __init__(self, worker_id: WorkerId) -> None:
        self.worker_id = worker_id
        # what this proxy has open on the worker, in the order it was sent (a dict keeps insertion order:
        # one pump sends many in one instant, so their times cannot tell the newest)
        self.attempts: dict[Attempt, None] = {}
        self.batch_attempts: dict[Attempt, None] = {}  # of those, the batch class's, likewise
        self.dispatched = 0  # D: total dispatched (monotonic)
        self.completed = 0  # C: total finished, whatever the outcome (monotonic)
        self.sample: Sample | None = None  # the latest good scrape
        self.error: str | None = None  # why the latest scrape failed (None if it worked)
        self.last_running = 0  # #running-req of the latest good sample
        self.output_rate: float | None = None  # output tokens/s: the engine's figure, else its counter's rate
        self.limit: int | None = None  # the fast tier's admission limit: at most this many in flight
        self.queue_target: int | None = None  # the fast tier's server-queue target (None: the band's)
        self.batch_queue_target: int | None = None  # the batch class's, beside interactive (None: queue_target)
        # the fast tier's beside interactive work: at most this many batch requests open here (None: no cap)
        self.batch_limit: int | None = None
        # the fast tier's: a streamed interactive request waiting this long for its first token holds batch refills
        self.first_token_wait_s: float | None = None
        # the fast tier's output budgets: (interactive?, max_tokens asked) -> the max_tokens such a request is sent with
        self.output_budgets = OutputBudgets()
        self.facts = WorkerFacts()  # the worker's recent requests as the relay saw them
        self.batch_paced_until = -math.inf  # the dispatcher's batch pacing: no batch request before this
        self._base_dispatched = 0
        self._base_completed = 0
        self._pending_base: tuple[int, int] | None = None
        self._idle: asyncio.Event | None = None

    # -- request accounting -----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests this proxy has open on the worker."""
        return len(self.attempts)

    def budget_summary(self) -> dict[str, dict[str, int]]:
        """The output budgets per class, by the ``max_tokens`` asked (the status page's)."""
        out: dict[str, dict[str, int]] = {"interactive": {}, "batch": {}}
        for (interactive, asked), budget in self.output_budgets.items():
            out["interactive" if interactive else "batch"][str(asked)] = budget
        return out

    def output_budget(self, *, interactive: bool, max_tokens: int | None) -> int | None:
        """The ``max_tokens`` a request of the class that asks for ``max_tokens`` is sent with (None: as
        asked; see :mod:`proxy.request.continuation`): requests that ask alike write alike."""
        return None if max_tokens is None else self.output_budgets.get((interactive, max_tokens))

    @property
    def batch_in_flight(self) -> int:
        """Batch requests this proxy has open on the worker."""
        return len(self.batch_attempts)

    @property
    def interactive_in_flight(self) -> int:
        """Requests of the other classes (interactive) this proxy has open on the worker."""
        return len(self.attempts) - len(self.batch_attempts)

    def reserve(self, attempt: Attempt, *, batch: bool = False) -> None:
        self.attempts[attempt] = None
        self.dispatched += 1
        if batch:
            self.batch_attempts[attempt] = None

    def release(self, attempt: Attempt) -> None:
        """The attempt is over; a second release of the same attempt is a no-op."""
        if attempt not in self.attempts:
            return
        del self.attempts[attempt]
        self.completed += 1
        self.batch_attempts.pop(attempt, None)
        if not self.attempts and self._idle is not None:
            self._idle.set()

    # -- scrapes ----------------------------------------------------------------------------------
    def scrape_started(self) -> None:
        self._pending_base = (self.dispatched, self.completed)

    def record(self, sample: Sample) -> None:
        base = self._pending_base or (self.dispatched, self.completed)
        self._base_dispatched, self._base_completed = base[0], self.completed
        self._pending_base = None
        self.output_rate = output_rate(self.sample, sample)
        self.sample = sample
        self.error = None
        self.last_running = sample.running

    def record_error(self, error: str) -> None:
        self._pending_base = None
        self.error = error

    def forget_sample(self) -> None:
        """The worker restarted or went away: its last sample no longer describes it."""
        self.sample = None
        self.output_rate = None
        self._pending_base = None

    # -- reading ----------------------------------------------------------------------------------
    def has_room(self, now: float, *, batch: bool = False) -> bool:
        """Whether one more request of the class may go to the worker: under the admission limit (a
        batch request counts everything in flight there, an interactive one only the interactive
        ones); for a batch request also under the batch's own ``batch_limit``, and no interactive
        request overdue for its first token there while the batch already has one in flight
        (:meth:`first_token_overdue`)."""
        if batch and self.batch_limit is not None and len(self.batch_attempts) >= self.batch_limit:
            return False
        if batch and self.batch_attempts and self.first_token_overdue(now):
            return False
        if self.limit is None:
            return True
        counted = self.in_flight if batch else self.interactive_in_flight
        return counted < self.limit

    def first_token_overdue(self, now: float) -> bool:
        """Whether a streamed interactive request open on the worker has waited longer than the fast
        tier's ``first_token_wait_s`` for its first token: it waits at the worker for room (the KV a
        batch refill would take, or behind batch requests in the worker's queue). Whole answers are
        not counted: their first token is not seen."""
        wait = self.first_token_wait_s
        if wait is None or len(self.attempts) == len(self.batch_attempts):
            return False
        due = now - wait
        for a in self.attempts:  # in the order they were dispatched: past ``due`` the rest are newer
            if a.dispatched_at >= due:
                return False
            if a.streamed and not a.started and not a.taken_back and a not in self.batch_attempts:
                return True
        return False

    def target(self, band: Band, *, batch: bool = False) -> int:
        """The server-queue depth the gate keeps for this worker: the fast tier's, inside the band."""
        own = self.batch_queue_target if batch and self.batch_queue_target is not None else self.queue_target
        if own is None:
            return band.target
        return max(1, min(own, band.hi))

    def open_requests(
        self,
        now: float,
        step_s: float,
        expected: Callable[[bool], tuple[float | None, float | None]],
        *,
        interactive: bool,
    ) -> list[tuple[int, int]]:
        """Each request of the class open on the worker as (KV tokens it holds, output tokens it is
        expected still to write), estimated from what the proxy knows: its prompt (its class's recent
        answers' mean prompt as the engine counted it, ``expected(interactive)[0]``; else the proxy's
        estimate from its bytes), and as written so far the decode steps since it was sent (``step_s``
        each) up to the output expected of its class (``expected(interactive)[1]``: the class's recent
        answers' mean output; else the ``max_tokens`` it was sent with, the most it writes). The newest,
        as many as the scrape's queue shows waiting there (FIFO), have written nothing yet."""
        s = self.sample
        waiting = 0 if s is None else s.queue
        prompt_mean, mean = expected(interactive)
        out: list[tuple[int, int]] = []
        for n, a in enumerate(reversed(self.attempts)):
            if (a not in self.batch_attempts) is not interactive:
                continue
            ticket = a.ticket
            asked = a.sent_max_tokens or ticket.max_tokens
            total = mean if mean is not None else asked
            if total is None:
                continue  # nothing known of what it writes: it cannot be projected
            if asked is not None:
                total = min(total, asked)
            written = 0.0 if n < waiting or step_s <= 0 else min(total, (now - a.dispatched_at) / step_s)
            prompt = prompt_mean if prompt_mean is not None else ticket.prompt_tokens or 0
            out.append((int(prompt + written), max(0, round(total - written))))
        return out

    def waiting_batch(self, keep: int) -> list[Attempt]:
        """The batch attempts waiting in the worker's queue beyond its ``keep`` oldest, newest first.

        The worker's queue is FIFO, so what waits there is the newest of what this proxy sent, as many
        as the scrape's queue moved forward by the proxy's own dispatches and completions since (the
        first term of ``est_queue`` only: the second errs high, and a running request taken back
        would be computed again); of those, the batch ones that have no output yet, less the ``keep``
        oldest (next to be admitted). Requests the engine retracted wait there too, ahead of the
        newest, so the count errs towards a few running ones at worst."""
        s = self.sample
        if s is None:
            return []
        since = (self.dispatched - self._base_dispatched) - (self.completed - self._base_completed)
        waiting = list(reversed(self.attempts))[: max(0, s.queue + since)]
        batch = [a for a in waiting if a in self.batch_attempts and not a.started and not a.taken_back]
        return batch[: max(0, len(batch) - keep)]

    def newest_batch(self, count: int) -> list[Attempt]:
        """Up to ``count`` of the batch attempts on the worker that have sent no output, newest first:
        the ones that have done the least work there (queued, or the fewest tokens decoded)."""
        if count <= 0:
            return []
        return [a for a in reversed(self.batch_attempts) if not a.started and not a.taken_back][:count]

    def engine_step_s(self) -> float | None:
        """The worker's decode step time as the latest scrape shows it (``running`` requests each get
        one token a step: ``running / output tokens per second``); None without a sample, a running
        request or an output rate."""
        s, rate = self.sample, self.output_rate
        if s is None or s.running <= 0 or rate is None or rate <= 0:
            return None
        return s.running / rate

    def fresh(self, now: float, stale_after_s: float) -> bool:
        s = self.sample
        return s is not None and self.error is None and now - s.time <= stale_after_s

    def est_queue(self) -> int:
        """The formula of the module docstring; 0 without a sample."""
        s = self.sample
        if s is None:
            return 0
        since = (self.dispatched - self._base_dispatched) - (self.completed - self._base_completed)
        return max(0, s.queue + since, self.in_flight - s.running)

    async def wait_idle(self) -> None:
        """Return once nothing of this proxy is in flight on the worker."""
        while self.attempts:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    def snapshot(self) -> dict[str, object]:
        s = self.sample
        return {
            "in_flight": self.in_flight,
            "est_queue": self.est_queue(),
            "limit": self.limit,
            "batch_limit": self.batch_limit,
            "queue_target": self.queue_target,
            "batch_queue_target": self.batch_queue_target,
            "output_rate": self.output_rate,  # output tokens/s now (0 when nothing runs)
            "output_budget": self.budget_summary(),
            "facts": self.facts.summary(),
            "scrape_error": self.error,
            "sample": None
            if s is None
            else {
                "time": s.time,
                "queue": s.queue,
                "running": s.running,
                "token_usage": s.token_usage,
                "gen_throughput": s.gen_throughput,
                "cache_hit_rate": s.cache_hit_rate,
                "max_total_tokens": s.max_total_tokens,
            },
        }


class LoadBoard:
    """Every worker's :class:`WorkerLoad`, plus observers of new samples.

    Observers (``fn(worker_id, sample, error)``) are called synchronously after each scrape: the
    controller consumes the same samples as the dispatcher, there is no second scraper.
    """

    def __init__(self) -> None:
        self._loads: dict[WorkerId, WorkerLoad] = {}
        self._observers: list[SampleObserver] = []

    def get(self, worker_id: WorkerId) -> WorkerLoad:
        load = self._loads.get(worker_id)
        if load is None:
            load = self._loads[worker_id] = WorkerLoad(worker_id)
        return load

    def __iter__(self) -> Iterator[WorkerLoad]:
        return iter(list(self._loads.values()))

    def total_in_flight(self) -> int:
        return sum(w.in_flight for w in self._loads.values())

    def subscribe(self, observer: SampleObserver) -> None:
        self._observers.append(observer)

    def unsubscribe(self, observer: SampleObserver) -> None:
        self._observers.remove(observer)

    def publish(self, worker_id: WorkerId, sample: Sample | None, error: str | None) -> None:
        load = self.get(worker_id)
        if sample is not None:
            load.record(sample)
        else:
            load.record_error(error or "scrape failed")
        for observer in list(self._observers):
            observer(worker_id, sample, error)
