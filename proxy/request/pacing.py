"""Per-worker load as the proxy knows it: its own in-flight count plus the latest scraped sample.

One :class:`WorkerLoad` per worker lives in a :class:`LoadBoard`, shared by the dispatcher (which
reserves and releases), the scraper (which records samples and errors), the status log, the admin
API and the rollout (which waits for a worker to empty). What is in flight on a worker is its open
attempts in the order they were sent; whether it may get new requests is the pool's state.

Estimated server-side queue (what the pacing gate compares with the band)::

    est_queue = max(0, q_s + (D - D_s) - (C - C_s), in_flight - r_s)

``q_s``/``r_s``: queue and running of the latest sample; ``D``/``C``: requests this proxy sent to /
saw finish on the worker, ``D_s`` taken when the scrape was sent and ``C_s`` when it came back. The
first term moves the scrape forward by the proxy's own events; the second bounds it when
completions arrive after the worker refilled its slots. Both err high, so the band's top holds.

The interactive protection's numbers come from the worker: its running-request limit (its server
info, else its launch arguments) gives the batch's share beside interactive work and its prompt
tokens per engine step (:func:`batch_in_flight_cap`, :func:`batch_prefill_tokens_per_step`), the
step read from its scrapes. A stale sample counts as saturated (the dispatcher's fallback).
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

Reserve = Callable[[int, int, bool], int]  # (held, may write, running) -> the KV an engine's admission counts
_UNBOUNDED = 1 << 30  # what a request sent without max_tokens may write (an engine clips what it counts)

# the gate tops the worker's queue up once a scrape and the engine admits from it in between: twice the
# limit keeps it past the limit from one scrape to the next
PAST_PREFIX_LIMIT = 2

SampleObserver = Callable[[WorkerId, "Sample | None", "str | None"], None]

# The interactive protection beside a batch (what met the Batch API's target: docs/benchmarks.md,
# "cap-headroom-paced", on a worker running at most 256: 1 waiting, 240 in flight, 1.25, 512 tokens).
# Batch requests waiting in a worker's own queue beside interactive work: one, so an interactive request
# waits there behind at most one batch prompt, and a batch completion still finds the next one ready.
BATCH_QUEUE_BESIDE_INTERACTIVE = 1
# How long after the latest interactive arrival the batch stays held back beside it, in the engine's
# seconds (a worker's clock rate converts it to the wall's): 5 s spans the pause between two turns of a
# chat, so its next message does not find the batch back at full width; a quiet spell longer than
# that gives the batch its whole share again.
INTERACTIVE_WINDOW_S = 5.0
# Running slots kept per interactive request open on a worker: beside a batch each one runs longer (every
# arrival's prefill is a forward the decode steps wait for); a quarter more than they hold lets the
# interactive traffic vary between two arrivals without waiting for a batch request to end.
INTERACTIVE_SLOT_HEADROOM = 1.25
# A sixteenth of a worker's running slots (at least one) stays free beside interactive work: room for the
# arrivals between two of the proxy's looks, whatever the traffic.
RESERVE_SHARE = 16
# Batch prompt tokens per engine step per running slot: a wave of batch completions is refilled a few
# requests a step instead of as one long prefill, and a batch whose prompts are up to twice its answers
# is still refilled as fast as its requests end.
PROMPT_TOKENS_PER_SLOT = 2


def batch_in_flight_cap(running_limit: int) -> int:
    """The batch requests a worker that runs at most ``running_limit`` requests at once may hold beside
    interactive work: the limit less its reserve (:data:`RESERVE_SHARE`), at least one."""
    reserve = max(1, math.ceil(running_limit / RESERVE_SHARE))
    return max(1, running_limit - reserve)


def batch_prefill_tokens_per_step(running_limit: int) -> int:
    """The batch prompt tokens a worker that runs at most ``running_limit`` requests at once is sent per
    engine step beside interactive work (:data:`PROMPT_TOKENS_PER_SLOT` per running slot)."""
    return PROMPT_TOKENS_PER_SLOT * max(1, running_limit)


def slots_held_for_interactive(interactive_in_flight: int) -> int:
    """Running slots kept for the interactive requests open on a worker (:data:`INTERACTIVE_SLOT_HEADROOM`
    each, rounded up: at least one each, so a batch request is not let in where the next arrival would
    take it back)."""
    return math.ceil(INTERACTIVE_SLOT_HEADROOM * interactive_in_flight)


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
        "_dropping",
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
        "held_open",
        "incarnation",
        "interactive_asks",
        "last_running",
        "limit",
        "made_room_at",
        "output_budgets",
        "output_rate",
        "prefix_limit",
        "queue_past",
        "queue_target",
        "replicas",
        "running_limit",
        "running_seen",
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
        self.made_room_at = -math.inf  # when a batch request was last taken back for a first token due here
        # the newest interactive request seen open here: (its prompt tokens, the max_tokens it went with)
        self.interactive_asks: tuple[int, int | None] | None = None
        # the fast tier's output budgets: (interactive?, max_tokens asked) -> the max_tokens such a request is sent with
        self.output_budgets = OutputBudgets()
        self.facts = WorkerFacts()  # the worker's recent requests as the relay saw them
        self.batch_paced_until = -math.inf  # the dispatcher's batch pacing: no batch request before this
        # the most requests the worker runs at once, as it reports it (its server info) or was started with
        self.running_limit: int | None = None
        # the most requests held open here: the batch its CUDA graphs cover, where the planner's twin
        # priced holding it there a gain (proxy.control.hold; None: no hold)
        self.held_open: int | None = None
        # the queue past which the worker's engine no longer orders it by prefix (its launch arguments;
        # None: it never does), and whether its queue is kept past that (the planner's twin priced it)
        self.prefix_limit: int | None = None
        self.queue_past = False
        self.running_seen = 0  # the most it was scraped running (at most its limit, whatever that is)
        # the proxy replicas sending to the worker (LoadBoard.set_replicas): each paces its share
        self.replicas = 1
        self._base_dispatched = 0
        self._base_completed = 0
        self._pending_base: tuple[int, int] | None = None
        self._idle: asyncio.Event | None = None
        self.incarnation: int | None = None  # the worker process its samples describe (its pid; None: not known)
        self._dropping = False  # forgotten since the last scrape began: what that scrape brings back is dropped

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
        asked; see :mod:`proxy.request.continuation`): requests that ask alike write alike. A budget
        the controller holds back while it measures it sends them as they went before it."""
        return None if max_tokens is None else self.output_budgets.sent_with((interactive, max_tokens))

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
        self._dropping = False

    def record(self, sample: Sample) -> None:
        if self._dropping:  # begun before the worker restarted: the process it read is gone
            return
        base = self._pending_base or (self.dispatched, self.completed)
        self._base_dispatched, self._base_completed = base[0], self.completed
        self._pending_base = None
        self.output_rate = output_rate(self.sample, sample)
        self.sample = sample
        self.error = None
        self.last_running = sample.running
        self.running_seen = max(self.running_seen, sample.running)

    def record_error(self, error: str) -> None:
        self._pending_base = None
        if not self._dropping:  # a scrape of the process gone says nothing of the new one
            self.error = error

    def new_process(self) -> None:
        """Another process serves under the worker's id: the levers the planner's looks priced for the
        old one (the hold at its graphs, its queue's side of the prefix limit) are priced anew, as the
        controller forgets them when the worker starts. A drain that ends with the same process serving
        keeps them, as the controller does."""
        self.held_open = None
        self.queue_past = False

    def forget_sample(self) -> None:
        """The worker restarted or went away: its last sample no longer describes it."""
        self.sample = None
        self.error = None  # its scrapes failing, as a process dies, say nothing of the next one
        self.output_rate = None
        self._pending_base = None
        self._dropping = True
        self.running_seen = 0  # a restarted worker may run a different number (its limit is read again)
        self.running_limit = None
        # nor its batch: until its first scrape it is gated on its own counts (:attr:`unscraped`), and if that
        # scrape fails, the stale fallback starts from none (the reshape benchmark's tp-8 worker had run 768;
        # restarted as one of four tp-2 workers and up first, it was sent all 1,024 requests taken back)
        self.last_running = 0
        # and the fast tier's numbers for it are the old process's until its next look: the reshape's first
        # tp-2 worker kept the tp-8 worker's queue target and took the requests taken back before the
        # other three were up
        self.limit = self.queue_target = self.batch_queue_target = self.batch_limit = None

    # -- reading ----------------------------------------------------------------------------------
    def has_room(self, now: float, *, batch: bool = False) -> bool:
        """Whether one more request of the class may go to the worker: under the admission limit (a
        batch request counts everything in flight there, an interactive one only the interactive
        ones); for a batch request also under the batch's own ``batch_limit``, and no interactive
        request held up there for its first token while the batch already has one in flight
        (:meth:`first_token_held_up`)."""
        if batch and self.batch_limit is not None and len(self.batch_attempts) >= self.batch_limit:
            return False
        if batch and self.batch_attempts and self.first_token_held_up(now):
            return False
        if self.limit is None:
            return True
        counted = self.in_flight if batch else self.interactive_in_flight
        return counted < self.limit

    def batch_room_beside_interactive(self) -> bool:
        """Whether one more batch request may go to the worker beside interactive work: the batch's
        share (:func:`batch_in_flight_cap`) less the slots held for the interactive requests open there
        (:func:`slots_held_for_interactive`).

        No share where the worker's running limit is not known (vLLM without ``max_num_seqs`` in its
        arguments, an external worker without server info): a scrape shows the most it runs only while
        requests wait there, and beside interactive work the batch keeps one waiting, so a limit guessed
        from scrapes would stay as low as the first guess and hold the batch below what the worker runs.
        Such a worker gets the queue cap and the paced refills (:meth:`batch_step_tokens`)."""
        limit = self.running_limit
        if limit is None:
            return True
        cap = batch_in_flight_cap(limit) - slots_held_for_interactive(self.interactive_in_flight)
        return len(self.batch_attempts) < cap

    def batch_over_share(self) -> int:
        """Batch requests on the worker beyond its share beside interactive work (the cap less one slot
        per interactive request open there), not counting those already taken back: what an interactive
        arrival takes back. 0 while the worker's running limit is unknown."""
        limit = self.running_limit
        if limit is None or len(self.attempts) <= batch_in_flight_cap(limit):  # the hot path: no walk
            return 0
        held = sum(1 for a in self.batch_attempts if not a.taken_back)  # those taken back are on their way out
        return max(0, held + self.interactive_in_flight - batch_in_flight_cap(limit))

    def batch_step_tokens(self) -> int | None:
        """Batch prompt tokens per engine step beside interactive work (:func:`batch_prefill_tokens_per_step`)
        of the worker's running limit; where that is not known, of the most it was seen running (a lower
        bound: slower refills, on the interactive side; they speed up as the batch fills the worker).
        None (unpaced) before either is known."""
        limit = self.running_limit or self.running_seen
        return batch_prefill_tokens_per_step(limit) if limit else None

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
            if self._awaits_first_token(a):
                return True
        return False

    def first_token_held_up(self, now: float) -> bool:
        """Whether an interactive request waits at the worker for its first token: overdue
        (:meth:`first_token_overdue`), or the latest scrape shows requests waiting there while a streamed
        interactive request has no first token yet. A batch request sent then would wait there beside
        it for the same room, and an engine that orders its queue by cached prefix admits a batch
        request going on from its text first."""
        if self.first_token_overdue(now):
            return True
        s = self.sample
        if s is None or s.queue <= 0 or len(self.attempts) == len(self.batch_attempts):
            return False
        return any(self._awaits_first_token(a) for a in reversed(self.attempts))  # the newest most likely

    def _awaits_first_token(self, a: Attempt) -> bool:
        """A streamed interactive attempt still open here without its first token."""
        return a.streamed and not a.started and not a.taken_back and a not in self.batch_attempts

    def target(self, band: Band, *, batch: bool = False) -> int:
        """The server-queue depth the gate keeps for this worker: the fast tier's, inside the band."""
        held_back = batch and self.batch_queue_target is not None  # the batch's own, beside interactive work
        own = self.batch_queue_target if held_back else self.queue_target
        target = band.target if own is None else max(1, min(own, band.hi))
        sides = self.queue_sides(band)
        if sides is None:
            return target
        return max(target, sides[1]) if self.queue_past and not held_back else min(target, sides[0])

    def queue_sides(self, band: Band) -> tuple[int, int] | None:
        """The two targets open to the gate where the worker's engine orders its queue by prefix up to a
        limit (SGLang's lpm): at the limit (ordered every round) and past it (arrival order, no prefix
        matching). A target across the limit has the engine switch order from one round to the next: the
        cost of one without the gain of the other. None: no such limit, or the band stops at it."""
        limit = self.prefix_limit
        if limit is None or band.hi <= limit:
            return None
        return limit, min(band.hi, PAST_PREFIX_LIMIT * limit)

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

    def admission_taken(
        self, now: float, step_s: float, prompt_of: Callable[[bool], float | None], reserve: Reserve
    ) -> int:
        """The KV tokens the engine's admission counts as taken by what this proxy has open on the
        worker (``reserve(held, may_write, running)``: the engine's rule), estimated as
        :meth:`open_requests` does: a request holds its prompt (``prompt_of(interactive)``, its class's
        recent mean, else the proxy's estimate) and a token per decode step since it was sent; the
        newest, as many as the scrape's queue shows waiting there, hold nothing yet and count as new
        requests. A request sent without ``max_tokens`` may write as much as the engine counts."""
        s = self.sample
        waiting = 0 if s is None else s.queue
        taken = 0
        for n, a in enumerate(reversed(self.attempts)):
            ticket = a.ticket
            asked = a.sent_max_tokens or ticket.max_tokens
            may_write = _UNBOUNDED if asked is None else asked
            running = n >= waiting
            written = 0 if not running or step_s <= 0 else min(may_write, int((now - a.dispatched_at) / step_s))
            prompt = prompt_of(a not in self.batch_attempts)
            held = int(prompt if prompt is not None else ticket.prompt_tokens or 0)
            taken += reserve(held + written, may_write - written, running)
        return taken

    def admission_shares(
        self, now: float, step_s: float, prompt_of: Callable[[bool], float | None], reserve: Reserve, pool: int
    ) -> tuple[float, float | None]:
        """As shares of the worker's KV pool: what its admission counts taken (:meth:`admission_taken`)
        plus what the next interactive request needs to be admitted (the newest one open's prompt and
        ``max_tokens``, else the last seen); and what one more batch request counts once running (None: no batch open)."""
        taken = self.admission_taken(now, step_s, prompt_of, reserve)
        chat = next((a for a in reversed(self.attempts) if a not in self.batch_attempts), None)
        if chat is not None:
            sent = chat.sent_max_tokens if chat.sent_max_tokens is not None else chat.ticket.max_tokens
            self.interactive_asks = (chat.ticket.prompt_tokens or 0, sent)
        if self.interactive_asks is not None:
            prompt, asked = self.interactive_asks
            chat_prompt = prompt_of(True)
            held = int(chat_prompt) if chat_prompt is not None else prompt
            taken += reserve(held, _UNBOUNDED if asked is None else asked, False)
        newest = next(reversed(self.batch_attempts), None)
        if newest is None:
            return taken / pool, None
        asked = newest.sent_max_tokens or newest.ticket.max_tokens
        batch_prompt = prompt_of(False)
        held = int(batch_prompt) if batch_prompt is not None else newest.ticket.prompt_tokens or 0
        return taken / pool, reserve(held, _UNBOUNDED if asked is None else asked, True) / pool

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

    def batch_to_fit(self, waiting: Attempt) -> int:
        """How many of the newest batch requests (:meth:`newest_batch`) to take back for ``waiting`` to fit:
        enough that what they may hold in full (prompt and ``max_tokens`` sent) covers what it may need in
        full, at least one. An engine admits a request when its prompt and the output it reserves fit; a
        request's size not known counts as one."""
        need = _may_need(waiting)
        count, freed = 0, 0
        for attempt in self.newest_batch(len(self.batch_attempts)):
            count, freed = count + 1, freed + _may_need(attempt)
            if freed >= need:
                break
        return max(1, count)

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

    @property
    def unscraped(self) -> bool:
        """Not scraped since it (re)started, and no scrape has failed: gated on its own counts."""
        return self.sample is None and self.error is None

    def est_queue(self) -> int:
        """The formula of the module docstring; without a sample, everything in flight."""
        s = self.sample
        if s is None:
            return self.in_flight
        since = (self.dispatched - self._base_dispatched) - (self.completed - self._base_completed)
        # with N replicas each sees the whole queue at a scrape but only its own sends since: counted
        # N-fold, each fills its share (1/N) of the room left in the band until the next scrape
        return max(0, s.queue + since * self.replicas, self.in_flight - s.running)

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
            "running_limit": self.running_limit,
            "held_open": self.held_open,
            "prefix_limit": self.prefix_limit,
            "queue_past": self.queue_past,
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


def _may_need(attempt: Attempt) -> int:
    """The KV tokens an attempt may hold in full: its prompt and the ``max_tokens`` it was sent with
    (0 where neither is known)."""
    ticket = attempt.ticket
    output = attempt.sent_max_tokens if attempt.sent_max_tokens is not None else ticket.max_tokens
    return (ticket.prompt_tokens or 0) + (output or 0)


class LoadBoard:
    """Every worker's :class:`WorkerLoad`, plus observers of new samples.

    Observers (``fn(worker_id, sample, error)``) are called synchronously after each scrape: the
    controller consumes the same samples as the dispatcher, there is no second scraper.
    """

    def __init__(self) -> None:
        self._loads: dict[WorkerId, WorkerLoad] = {}
        self._observers: list[SampleObserver] = []
        self.replicas = 1  # the proxy replicas in front of these workers (set_replicas)

    def get(self, worker_id: WorkerId) -> WorkerLoad:
        load = self._loads.get(worker_id)
        if load is None:
            load = self._loads[worker_id] = WorkerLoad(worker_id)
            load.replicas = self.replicas
        return load

    def set_replicas(self, count: int) -> None:
        """``count`` proxy replicas (at least 1) send to these workers: each paces its share."""
        self.replicas = max(1, count)
        for load in self._loads.values():
            load.replicas = self.replicas

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
