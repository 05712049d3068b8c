"""Which worker gets the next queued request, and when (the pacing gate).

A worker is eligible while it is READY, under the fast tier's admission limit, its sample fresh,
and its estimated queue (:mod:`proxy.request.pacing`) under its target (the fast tier's, else
``min(band.lo + headroom, band.hi)``); with no fresh sample anywhere, the proxy's own counts gate.
Beside interactive work (one within ``INTERACTIVE_WINDOW_S`` engine seconds, on the workers' clock) the batch is held back further, by
numbers derived from the worker's running-request limit (:mod:`proxy.request.pacing`): a short
batch queue on the worker, a cap on its batch requests open there less slots per interactive
request open (batch past it taken back, newest first), and refills paced by prompt tokens per
engine step, so a wave of completions is not one long prefill the chats wait behind. When the
batch's turn comes and its gates hold it, the interactive head goes instead.
Among eligible workers: least estimated queue, then least in flight; with prefix affinity
(``lpm``) a rendezvous hash of the prompt's prefix. A retry avoids the workers it failed on.

:class:`Dispatcher` runs the gate whenever something changes (:meth:`Dispatcher.pump` is
synchronous: no polling loop, no sleep on the hot path). :meth:`Dispatcher.attempt` owns an
attempt's lifecycle: leaving its block releases the slot, and the ticket is requeued exactly when
no output was sent and the request still wants an answer (a take-back, a failure with a retry left,
a refused connection, which spends no attempt), or a started stream's worker broke and its
answer goes on from its text (``WorkerLost``). So a request is answered once, by its handler.
Errors are exceptions (``QueueFull``, ``QueueTimeout``, ``ProxyClosing``, ``NoWorker``); "no worker
now" is a ``None`` from :func:`choose_worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from proxy.request.admission import AdmissionQueue, Priority, QueueFull
from proxy.request.attempt import Attempt, AttemptFailed, Requeued, TakenBack, Ticket, WorkerLost
from proxy.request.pacing import BATCH_QUEUE_BESIDE_INTERACTIVE, INTERACTIVE_WINDOW_S, Band, LoadBoard, WorkerLoad
from proxy.workers.base import WorkerId, WorkerInfo, WorkerPool, WorkerState
from proxy.workers.exit_text import how_it_ended

__all__ = ["Dispatcher", "NoWorker", "ProxyClosing", "QueueFull", "QueueTimeout", "choose_worker", "worker_words"]

_log = logging.getLogger(__name__)


def worker_words(w: WorkerInfo) -> str:
    """A worker's state in words a client may be told: its state, how its process ended, whether it
    stays down or loops. Never what it printed (another caller's text with ``--log-requests``, paths,
    hosts): the operator's views (``/admin/workers``, ``pacer status``, the journal) have that."""
    words = f"{w.id} {w.state}"
    if w.state is WorkerState.DOWN and w.exit_code is not None:
        words += f" ({how_it_ended(w.exit_code)})"
    if w.stays_down:
        words += ", stays down"
    elif w.crash_loop:
        words += ", in a crash loop"
    return words


def _rendezvous(worker_id: str, key: str) -> int:
    return zlib.crc32(f"{worker_id}\x00{key}".encode())


def choose_worker(
    workers: Sequence[WorkerInfo],
    board: LoadBoard,
    *,
    band: Band,
    now: float,
    stale_after_s: float,
    exclude: frozenset[WorkerId] = frozenset(),
    affinity: str | None = None,
    batch: bool = False,
    beside_interactive: bool = False,
) -> WorkerId | None:
    """The worker the next request goes to, or ``None`` if it must wait (pure apart from reads).
    ``batch``: the request is of the batch class (the fast tier's limit and queue target per class);
    ``beside_interactive``: a batch request while interactive ones arrive, so only workers with room
    for the batch's share (:meth:`WorkerLoad.batch_room_beside_interactive`) whose batch pacing has come
    round (``batch_paced_until <= now``)."""
    ready: list[tuple[WorkerInfo, WorkerLoad]] = []
    for w in workers:
        if w.state is WorkerState.READY:
            ready.append((w, board.get(w.id)))
    if not ready:
        return None
    if exclude:
        others = [(w, load) for w, load in ready if w.id not in exclude]
        ready = others or ready
    ready = [(w, load) for w, load in ready if load.has_room(now, batch=batch)]
    if beside_interactive:
        ready = [
            (w, load) for w, load in ready if load.batch_room_beside_interactive() and load.batch_paced_until <= now
        ]
    # a worker not scraped since it started is gated on its own counts beside the fresh ones: counted as
    # saturated (stale), the reshape benchmark's new tp-2 workers got nothing for their first seconds while
    # the one whose sample came first took ~500 requests to wait
    fresh = [(w, load) for w, load in ready if load.fresh(now, stale_after_s) or load.unscraped]
    if fresh:
        open_ = [
            (load.est_queue(), load.in_flight, w.id)
            for w, load in fresh
            if load.est_queue() < load.target(band, batch=batch)
        ]
    else:  # every worker filtered out as stale: fall back to our own counts rather than stall (our share of
        # them behind several replicas: LoadBoard.set_replicas)
        open_ = [
            (load.in_flight, 0, w.id)
            for w, load in ready
            if load.in_flight * load.replicas < load.last_running + band.hi
        ]
    if not open_:
        return None
    if affinity is not None and len(open_) > 1:
        return max(open_, key=lambda o: _rendezvous(o[2], affinity))[2]
    return min(open_)[2]


def _take_back(attempt: Attempt, *, end_early: bool = True) -> None:
    """Mark the attempt taken back and end its block: its handler requeues the ticket (and aborts
    the request on the worker) unless output already went to the client. A whole answer the worker
    can end early and still give (the relay set ``on_take_back``) is ended there instead of cancelled,
    with ``end_early``: what the worker wrote comes back and the next attempt goes on from it."""
    attempt.taken_back = True
    if end_early and attempt.on_take_back is not None:
        attempt.on_take_back()
    elif attempt.task is not None:
        attempt.task.cancel()


class QueueTimeout(Exception):
    """A ticket waited past its deadline in the proxy queue."""


class ProxyClosing(Exception):
    """The proxy is shutting down: a queued (or newly submitted) request will not be dispatched."""


class NoWorker(Exception):
    """Every worker of the pool is down and stays down (nothing will start one again), or is in a
    crash loop (``for_good`` False: one may serve again): a queued (or newly submitted) request will
    not be dispatched. The message says which and why."""

    def __init__(self, message: str, *, for_good: bool) -> None:
        super().__init__(message)
        self.for_good = for_good


def _no_prefix_limit(args: Mapping[str, object]) -> int | None:
    return None


def _no_requeue_hook(why: Requeued) -> None:
    return None


class Dispatcher:
    """Owns the admission queue, the gate and every attempt's lifecycle; hands tickets to workers."""

    def __init__(
        self,
        pool: WorkerPool,
        board: LoadBoard,
        admission: AdmissionQueue,
        *,
        band: Band,
        stale_after_s: float,
        prefix_affinity: bool = False,
        prefix_limit: Callable[[Mapping[str, object]], int | None] = _no_prefix_limit,
        max_attempts: int = 3,
        on_requeue: Callable[[Requeued], None] = _no_requeue_hook,
        clock: Callable[[], float] = time.monotonic,
        interactive_window_s: float = INTERACTIVE_WINDOW_S,
        clock_rate: float = 1.0,
    ) -> None:
        self.pool = pool
        self.board = board
        self.admission = admission
        self.band = band
        self.stale_after_s = stale_after_s
        self.prefix_affinity = prefix_affinity
        self.prefix_limit = prefix_limit  # a worker's engine's prefix-order limit from its arguments
        self.max_attempts = max_attempts
        self.on_requeue = on_requeue  # counts requeues (the metrics)
        self.clock = clock
        # batch beside interactive: the band batch requests see while interactive ones keep arriving
        self.batch_band = Band(lo=min(BATCH_QUEUE_BESIDE_INTERACTIVE, band.hi), hi=band.hi)
        self.interactive_window_s = interactive_window_s  # in the engine's seconds...
        self.clock_rate = clock_rate  # ...on the pool's workers' clock (engine seconds per wall second)
        self._wake: asyncio.Handle | None = None  # the pump's next run for a paced batch request...
        self._wake_at = math.inf  # ...and when (the loop's time)
        self._interactive_seen = -float("inf")  # when the latest interactive request arrived
        # called as the first interactive request after a quiet ``interactive_window_s`` is queued, before it
        # is placed (the fast tier looks again at once instead of at the next scrape)
        self.on_interactive_spell: Callable[[], None] | None = None
        self.closing = False
        # why no request of this pool can be served now (every worker down for good or in a crash
        # loop), kept as the pool's states change: a request is refused on it without a look at them
        self._refusal: tuple[str, bool] | None = self._none_will_serve()
        self._pumping = False
        self._again = False

    # -- request side -----------------------------------------------------------------------------
    def submit(
        self,
        priority: Priority,
        timeout_s: float,
        affinity: str | None = None,
        *,
        key: str = "",
        cost: int = 1,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> Ticket:
        """Queue a new request of ``key`` (a key's name) estimated at ``cost`` tokens; raises
        :class:`QueueFull` or :class:`ProxyClosing`. ``prompt_tokens`` (estimated) and ``max_tokens``
        ride on the ticket for the planner's picture of the work in flight."""
        if self.closing:
            raise ProxyClosing()
        if self._refusal is not None:
            raise self._refused()
        now = self.clock()
        spell = priority is Priority.INTERACTIVE and not self._beside_interactive(now)
        if priority is Priority.INTERACTIVE:
            self._interactive_seen = now
        ticket = Ticket(
            priority,
            now,
            now + timeout_s,
            asyncio.get_running_loop().create_future(),
            affinity if self.prefix_affinity else None,
            key=key,
            cost=cost,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        pushed_out = self.admission.push(ticket)  # raises QueueFull
        if pushed_out is not None and not pushed_out.future.done():  # its handler answers 429, as a full queue does
            pushed_out.future.set_exception(
                QueueFull(
                    f"the proxy queue is full ({self.admission.capacity} requests waiting) and this key holds "
                    "the most of them: its newest request made room for another key's"
                )
            )
        if spell and self.on_interactive_spell is not None:
            self.on_interactive_spell()
        self.pump()
        if priority is Priority.INTERACTIVE:
            self._keep_slots_for_interactive()
        return ticket

    @contextlib.asynccontextmanager
    async def attempt(self, ticket: Ticket) -> AsyncIterator[Attempt]:
        """Wait for a worker, then own the attempt on it: the lifecycle of the module docstring."""
        attempt = await self._assigned(ticket)
        task = asyncio.current_task()
        attempt.task = task
        try:
            yield attempt
        except asyncio.CancelledError:
            self._release(attempt)
            # taken back: one cancel came from take_back; any other is the client leaving
            if attempt.taken_back and not attempt.started and task is not None and task.uncancel() == 0:
                self._requeue(ticket, attempt, Requeued.TAKEN_BACK)
                return
            raise
        except TakenBack:
            self._release(attempt)
            self._requeue(ticket, attempt, Requeued.TAKEN_BACK)
            return
        except WorkerLost:  # a started stream whose worker broke: it goes on from its text, elsewhere if it can
            self._release(attempt)
            ticket.exclude = ticket.exclude | {attempt.worker_id}
            self._requeue(ticket, attempt, Requeued.LOST)
            return
        except AttemptFailed as failure:
            self._release(attempt)
            if attempt.started:
                raise
            if attempt.taken_back:  # the worker went away while it was being taken back: no attempt spent
                self._requeue(ticket, attempt, Requeued.TAKEN_BACK)
                return
            if failure.gone:  # its worker died under it (the pool learns it from the process): wait for a live one
                self._requeue(ticket, attempt, Requeued.UNREACHABLE)
                return
            if failure.unreachable:
                self.pool.report_unreachable(attempt.worker_id, failure.message)
                if self.pool.get(attempt.worker_id).state is not WorkerState.READY:
                    _log.info("request back in the queue to wait for a live worker: %s", failure.message)
                    self._requeue(ticket, attempt, Requeued.UNREACHABLE)
                    return
            ticket.failures += 1
            if failure.retryable and ticket.failures < self.max_attempts:
                _log.info("retrying request (attempt %d failed): %s", ticket.failures, failure.message)
                ticket.exclude = ticket.exclude | {attempt.worker_id}
                self._requeue(ticket, attempt, Requeued.RETRY)
                return
            raise
        finally:
            attempt.task = None
            self._release(attempt)
            ticket.let_go(attempt)

    async def _assigned(self, ticket: Ticket) -> Attempt:
        """The ticket's next attempt; one taken back before its handler woke goes straight back."""
        while True:
            attempt = await self._wait(ticket)
            if not attempt.taken_back:
                return attempt
            self._release(attempt)
            self._requeue(ticket, attempt, Requeued.TAKEN_BACK)

    async def _wait(self, ticket: Ticket) -> Attempt:
        """Wait for the dispatcher to hand this ticket a worker; withdraws it on timeout/cancel."""
        fut = ticket.future
        if fut.done():
            return fut.result()
        remaining = ticket.deadline - self.clock()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                return await fut
        except TimeoutError:
            self._withdraw(ticket)
            raise QueueTimeout() from None
        except BaseException:
            self._withdraw(ticket)
            raise

    def _withdraw(self, ticket: Ticket) -> None:
        fut = ticket.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            attempt = fut.result()
            self._release(attempt)  # assigned in the same instant: give the slot back
            ticket.let_go(attempt)
        else:
            fut.cancel()
        self.admission.cancel(ticket)
        self.pump()

    def _requeue(self, ticket: Ticket, attempt: Attempt, why: Requeued) -> None:
        """Put a ticket whose attempt ended without output back at the front of its class.

        Its queue deadline starts again: a request taken back or retried late must not time out
        at once for time it spent on a worker.
        """
        attempt.requeued = why
        self.on_requeue(why)
        ticket.deadline = max(ticket.deadline, self.clock() + ticket.patience)
        ticket.future = asyncio.get_running_loop().create_future()
        if self.closing:
            ticket.future.set_exception(ProxyClosing())
            return
        if self._refusal is not None:
            ticket.future.set_exception(self._refused())
            return
        self.admission.requeue(ticket)
        self.pump()

    def _release(self, attempt: Attempt) -> None:
        """The attempt is over (answered, failed, taken back or abandoned): free its slot."""
        if attempt.released:
            return
        attempt.released = True
        self.board.get(attempt.worker_id).release(attempt)
        self.admission.on_worker(attempt.ticket, -1, answered=attempt.started)
        self.pump()

    def close(self) -> None:
        """Shutting down: refuse new tickets and fail every queued one with :class:`ProxyClosing`
        (their handlers answer 503 at once); attempts already on a worker run to completion."""
        self.closing = True
        if self._wake is not None:
            self._wake.cancel()
        self._fail_queued(ProxyClosing)

    def _fail_queued(self, error: Callable[[], Exception]) -> None:
        """Every queued ticket fails with an ``error()`` of its own: its handler answers at once."""
        for ticket in self.admission.drain_all():
            if not ticket.future.done():
                ticket.future.set_exception(error())

    def _refused(self) -> NoWorker:
        assert self._refusal is not None
        return NoWorker(self._refusal[0], for_good=self._refusal[1])

    def _none_will_serve(self) -> tuple[str, bool] | None:
        """Why no request can be served, and whether for good: every worker of the pool is down and
        stays down (the policy revives nothing) or dies as it starts (a crash loop the controller
        only revives); None while one serves or may start to."""
        workers = self.pool.workers()
        if not workers or not all(w.stays_down or w.crash_loop for w in workers):
            return None
        down = "; ".join(worker_words(w) for w in workers)
        if all(w.stays_down for w in workers):
            return f"no worker will serve this request: every worker is down and stays down ({down})", True
        return f"no worker serves this request now: every worker is down or in a crash loop ({down})", False

    # -- the gate ---------------------------------------------------------------------------------
    def pump(self) -> None:
        """Hand queued tickets to workers while the gate is open. Re-entrant calls coalesce."""
        if self._pumping:
            self._again = True
            return
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._pump_once()
        finally:
            self._pumping = False

    def _pump_once(self) -> None:
        admission = self.admission
        if not len(admission):
            return
        workers = self.pool.workers()
        now = self.clock()
        beside_interactive = self._beside_interactive(now)
        while True:
            ticket = admission.peek()
            if ticket is None:
                return
            worker_id = self._place(ticket, workers, now, beside_interactive)
            only: Priority | None = None
            if worker_id is None and ticket.priority is Priority.BATCH:
                # the batch's floor turn (or nothing else waits), but the gate holds it: when it is the
                # batch's own gates, the interactive head goes instead; the batch keeps its turn for the
                # next opening (when the gate holds both, nothing goes and the turn stays the batch's)
                if beside_interactive:
                    self._wake_for_pacing(workers, now)
                other = admission.peek(Priority.INTERACTIVE)
                if other is not None and (placed := self._place(other, workers, now, beside_interactive)):
                    ticket, worker_id, only = other, placed, Priority.INTERACTIVE
            if worker_id is None:
                return
            admission.pop(only)
            if ticket.future.done():  # cancelled between its last check and now
                continue
            admission.record_dispatch(ticket, now - ticket.enqueued_at)
            attempt = Attempt(ticket, worker_id, now)
            load = self.board.get(worker_id)
            batch = ticket.priority is Priority.BATCH
            load.reserve(attempt, batch=batch)
            admission.on_worker(ticket, 1)
            if batch and beside_interactive:
                self._pace_batch(load, ticket, now)
            elif not batch and load.batch_attempts:
                self._watch_first_token(load, attempt)
            ticket.future.set_result(attempt)

    def _place(
        self, ticket: Ticket, workers: Sequence[WorkerInfo], now: float, beside_interactive: bool
    ) -> WorkerId | None:
        """:func:`choose_worker` with the class's gates: a batch ticket beside interactive work sees the
        batch band, the batch's share of each worker and the pacing."""
        batch = ticket.priority is Priority.BATCH
        beside = batch and beside_interactive
        return choose_worker(
            workers,
            self.board,
            band=self.batch_band if beside else self.band,
            now=now,
            stale_after_s=self.stale_after_s,
            exclude=ticket.exclude,
            affinity=ticket.affinity,
            batch=batch,
            beside_interactive=beside,
        )

    def _pace_batch(self, load: WorkerLoad, ticket: Ticket, now: float) -> None:
        """A batch request went to the worker beside interactive work: the next may go once the engine
        has had the time to take this one's prompt at the worker's batch prompt tokens per step. Unpaced
        when the scrape shows no step time (nothing running yet: the first prefills cost nobody a wait)
        or the worker's running limit is unknown."""
        step, per_step = load.engine_step_s(), load.batch_step_tokens()
        if step is None or per_step is None:
            return
        tokens = max(1, ticket.prompt_tokens or 1)
        load.batch_paced_until = max(load.batch_paced_until, now) + step * tokens / per_step

    def _watch_first_token(self, load: WorkerLoad, attempt: Attempt) -> None:
        """An interactive request went to a worker that holds batch work: look again when its first
        token is due (the fast tier's ``first_token_wait_s``, a few decode steps; unwatched before the
        worker's step time is known)."""
        wait = load.first_token_wait_s
        if wait is None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing is served
            asyncio.get_running_loop().call_later(wait, self._first_token_due, load, attempt)

    def _first_token_due(self, load: WorkerLoad, attempt: Attempt) -> None:
        """A streamed interactive request is still without its first token a few decode steps after it
        was sent. Where the latest scrape shows requests waiting at the worker, it waits there behind
        batch prompts or for KV room: the batch requests queued there go back to the proxy's queue, or
        where none is, the newest batch requests running there whose prompt and output make room for its
        own are taken back (each keeps what it wrote and goes on later), once per due time however many
        wait. Then it is watched again. An empty server queue means it is not waiting there (its prefill
        runs, or the proxy is slow to relay): nothing is taken back for it."""
        if attempt.released or attempt.started or attempt.taken_back or not attempt.streamed or self.closing:
            return
        if load.sample is not None and load.sample.queue > 0:
            self._make_room(load, attempt)
        if load.batch_attempts:
            self._watch_first_token(load, attempt)

    def _make_room(self, load: WorkerLoad, waiting: Attempt) -> None:
        """The batch requests queued at the worker go back to the proxy's queue; where none is, the newest
        running batch requests that make room for ``waiting`` (:meth:`WorkerLoad.batch_to_fit`) are taken
        back, at most once per ``first_token_wait_s``."""
        wait, worker_id = load.first_token_wait_s, waiting.worker_id
        if self.withdraw_batch(worker_id, keep=0) or wait is None or self.clock() - load.made_room_at < wait:
            return
        load.made_room_at = self.clock()
        self.take_back_newest_batch(worker_id, load.batch_to_fit(waiting))

    def _wake_for_pacing(self, workers: Sequence[WorkerInfo], now: float) -> None:
        """Run the pump again when the first worker's batch pacing comes round (one timer at a time)."""
        due = [u for w in workers if (u := self.board.get(w.id).batch_paced_until) > now]
        if not due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        when = loop.time() + (min(due) - now)
        if self._wake is not None and self._wake_at <= when:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake, self._wake_at = loop.call_at(when, self._woken), when

    def _woken(self) -> None:
        self._wake, self._wake_at = None, math.inf
        self.pump()

    def _keep_slots_for_interactive(self) -> None:
        """An interactive request arrived: on a worker where the batch holds more than its share beside
        interactive work (:meth:`WorkerLoad.batch_over_share`), the newest batch requests beyond it are
        taken back to the proxy's queue and aborted on the worker, so an interactive request finds a
        running slot instead of waiting for a batch request to end. That is what happens when chat
        arrives after the batch filled the worker; in steady state the dispatch limit (which keeps
        1.25 slots per interactive request) leaves room for the traffic to vary before this takes any."""
        for worker in self.pool.workers():  # this dispatcher's workers (the board is shared by every pool's)
            over = self.board.get(worker.id).batch_over_share()
            if over:
                self.take_back_newest_batch(worker.id, over)

    # -- hooks for the state listener, the scraper and the rollout ----------------------------------
    def on_worker_state(self, info: WorkerInfo) -> None:
        load = self.board.get(info.id)
        # a new process under the same id (restarted, or a reshape's replica) is not what was scraped while
        # the old one drained: in the reshape benchmark the first tp-2 worker, read as the tp-8 running 768,
        # was sent all 1,024 requests taken back
        if info.state is not WorkerState.READY or info.pid != load.incarnation:
            load.forget_sample()
        if info.pid != load.incarnation:
            load.new_process()
        load.incarnation = info.pid
        load.prefix_limit = self.prefix_limit(info.args)
        if info.state is WorkerState.DOWN:
            self.fail_over(info.id)
        self._refusal = self._none_will_serve()
        if self._refusal is not None:
            self._fail_queued(self._refused)  # answered 503 at once, not at their queue timeout
        self.pump()

    def _beside_interactive(self, now: float) -> bool:
        """Whether an interactive request arrived within ``interactive_window_s`` of the workers' clock
        (the batch's gates apply)."""
        return now - self._interactive_seen < self.interactive_window_s / self.clock_rate

    def held_for_class(self) -> int:
        """Batch requests in the proxy's queue that their class's own gates hold there, not the band:
        beside interactive work (within ``interactive_window_s`` of the latest interactive arrival), or
        where the fast tier keeps a batch target on every worker serving. They wait by design while the
        worker's queue is empty."""
        batch = self.admission.depth(Priority.BATCH)
        if not batch:
            return 0
        if self._beside_interactive(self.clock()):
            return batch
        serving = [w for w in self.pool.workers() if w.state is WorkerState.READY]
        if serving and all(self.board.get(w.id).batch_queue_target is not None for w in serving):
            return batch
        return 0

    def open_attempts(self, worker_id: WorkerId) -> int:
        return self.board.get(worker_id).in_flight

    async def wait_idle(self, worker_id: WorkerId, timeout_s: float | None = None) -> bool:
        """Wait until nothing of this proxy is in flight on the worker; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.board.get(worker_id).wait_idle()
            return True
        except TimeoutError:
            return False

    def withdraw_batch(self, worker_id: WorkerId, keep: int) -> int:
        """Take back the batch requests waiting in the worker's queue beyond its ``keep`` oldest
        (:meth:`WorkerLoad.waiting_batch`), so interactive requests sent after them do not wait
        behind them there; they go back to the front of the batch class. Returns how many."""
        waiting = self.board.get(worker_id).waiting_batch(keep)
        for attempt in waiting:
            _take_back(attempt)
        return len(waiting)

    def take_back_newest_batch(self, worker_id: WorkerId, count: int) -> int:
        """Take back up to ``count`` of the batch requests open on the worker with no output yet, newest
        first (:meth:`WorkerLoad.newest_batch`: the least work done there; a whole answer the worker can end
        early keeps what it wrote and goes on from it). They wait at the front of the batch class.
        None while the proxy stops: what is on a worker ends there (taken back, it could only be refused)."""
        if self.closing:
            return 0
        taken = self.board.get(worker_id).newest_batch(count)
        for attempt in taken:
            _take_back(attempt)
        return len(taken)

    def fail_over(self, worker_id: WorkerId) -> int:
        """The worker is down: every request on it that sent its client nothing goes back to the front
        of the queue now, for a worker that serves (:meth:`take_back`, none ended early there: nothing
        there answers). A dead process's connections fail by themselves, but an engine whose launcher
        died (a Ray actor killed) may hold them open for minutes as it shuts down. Returns how many."""
        n = self.take_back(worker_id, end_early=False)
        if n:
            _log.warning(
                "worker %s is down: %d requests that had no output are back in the queue for a worker that serves",
                worker_id,
                n,
            )
        return n

    def take_back(self, worker_id: WorkerId, *, end_early: bool = True) -> int:
        """Requeue every request on the worker that produced no output yet; returns how many.

        Each one's ``async with`` block is cancelled (its upstream call is closed and aborted on
        the worker) and its ticket goes back to the front of the proxy queue; with ``end_early``, one
        the worker can end early gives what it wrote (:func:`_take_back`). Started requests run to
        the end. None while the proxy stops (as :meth:`take_back_newest_batch`).
        """
        if self.closing:
            return 0
        n = 0
        for attempt in list(self.board.get(worker_id).attempts):
            if attempt.started or attempt.taken_back:
                continue
            _take_back(attempt, end_early=end_early)
            n += 1
        return n
