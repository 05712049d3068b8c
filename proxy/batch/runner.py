"""The batch runner: executes the request lines of unfinished batches through an :class:`Executor`.

One driver task per unfinished batch; all drivers share ``concurrency`` slots (the proxy's
admission does the pacing; the runner only keeps it fed). A driver validates a ``validating``
batch, hands out its unanswered lines in input order, records each result before it counts (see
:mod:`proxy.batch.store`), and ends the batch:

- all lines answered: ``finalizing`` -> ``completed``;
- cancel: no new line starts; a line not yet on a worker is withdrawn; lines on a worker finish;
  the rest go to the error file as ``batch_cancelled``; ``cancelling`` -> ``cancelled``;
- the completion window ran out: the same, as ``batch_expired``; ``expired``.

A "not now" from the proxy (:class:`NotNow`: a full queue, a queue timeout, the key's rate limit)
is no result: the line gives its slot back and the batch starts nothing until its ``Retry-After``
has passed. So one key's limit holds no slot another owner's batch could use.

Started again on the same data directory, the runner resumes every unfinished batch: lines without
a recorded result run (again); finished results are never run or written twice.

On a shared store (PostgreSQL, several replicas) every replica's runner drives every unfinished
batch: each runs the lines it claimed (:meth:`~proxy.batch.store.BatchStore.claim_lines`), renews its
claims every third of :data:`CLAIM_S`, and looks every :data:`POLL_S` for batches another replica took, for
cancels made there, and for lines whose claim ran out (their replica died): a batch ends when no
line is left unanswered, whichever replica answered them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import orjson

from proxy.batch.shapes import NO_USAGE, error_line, output_line, parse_answer, usage_of
from proxy.batch.store import ActiveBatch, Answered, BatchStore, Ending, Outcome, PendingLine, StoreThread
from proxy.store import StoreUnavailable

_log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

CHUNK = 512  # lines read from the database at a time
# How long a replica's claim on a batch line lasts unrenewed; it is renewed every third of that. A dead
# replica's lines go to another within CLAIM_S + POLL_S (15 s): issue 45's time to replace a dead leader
# (a dead replica's concurrency slots come back within 15 s too, proxy.store.budgets). A live replica
# keeps its lines through two failed renewals: a store away for 9 s, as long as the leader lease rides
# out (proxy.workers.replicas). A claim that ran out under a live replica would run its line twice.
CLAIM_S = 14.0
# How often a runner on a shared store looks for batches made and cancels sent on other replicas and for
# lines whose claim ran out, and how soon it tries a store that did not answer again. A look is one
# query of a few milliseconds: a second costs the server next to nothing per replica, and a batch made
# or cancelled on one replica reaches the others within it.
POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class LineResult:
    """The upstream's answer to one request line: a 2xx goes to the output file, others to the error file."""

    status_code: int
    body: bytes  # JSON (anything else is kept as a string)
    request_id: str


class NotNow(Exception):
    """The proxy cannot take the line now: try it again after ``retry_after_s`` (its ``Retry-After``)."""

    def __init__(self, why: str, retry_after_s: float) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s


class Withdrawn(Exception):
    """``withdraw`` was set before the line reached a worker: it has no result (the batch was cancelled)."""


class Executor(Protocol):
    """Runs one request of a batch; ``owner`` identifies the API key the batch belongs to (a hash).

    It returns the final answer, or raises :class:`NotNow` (the runner tries again later) or
    :class:`Withdrawn` (``withdraw`` was set while the line had not reached a worker); any other
    exception fails the line with code ``internal_error``; cancellation means the runner is stopping
    and the line runs again on the next start.
    """

    async def execute(self, endpoint: str, body: dict[str, Any], owner: str, withdraw: asyncio.Event) -> LineResult: ...


class BatchRunner:
    def __init__(
        self,
        db: StoreThread,
        executor: Executor,
        *,
        concurrency: int,
        clock: Callable[[], float],
        accepts_model: Callable[[str], bool],
        claim_s: float = CLAIM_S,
        poll_s: float = POLL_S,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self._db = db
        self._claim_s = claim_s
        self._poll_s = poll_s
        self._claim_chunk = min(CHUNK, concurrency)  # on a shared store, no more than this runner can start
        self._recorder = _Recorder(db, poll_s)
        self._executor = executor
        self._clock = clock
        self._accepts_model = accepts_model
        self._slots = asyncio.Semaphore(concurrency)
        self._wake = asyncio.Event()
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}
        # a batch told "not now": no line of it starts before this (the event loop's time: a Retry-After
        # is a span of seconds; the completion window is on ``clock``)
        self._resume_at: dict[str, float] = {}

    async def _store(self, method: Callable[Concatenate[BatchStore, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await riding_out(self._db, self._poll_s, method, *args, **kwargs)

    def _now(self) -> int:
        return int(self._clock())

    @property
    def _shared(self) -> bool:
        """Other replicas run lines of the same batches (a shared store)."""
        return self._db.store.shared

    def kick(self) -> None:
        """A batch was created: look for work."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """The batch is ``cancelling`` in the store: start no new line of it from now on."""
        self._stops.setdefault(batch_id, asyncio.Event()).set()
        self._wake.set()

    async def run(self) -> None:
        """Drive every unfinished batch until cancelled (the running lines are cancelled with it)."""
        renewing = asyncio.create_task(self._renew_claims(), name="batch claims") if self._shared else None
        try:
            while True:
                self._wake.clear()
                for batch in await self._store(BatchStore.active_batches):
                    if batch.status == "cancelling" and batch.id in self._drivers:
                        self._stops.setdefault(batch.id, asyncio.Event()).set()  # maybe cancelled elsewhere
                    if batch.id not in self._drivers:
                        task = asyncio.create_task(self._drive(batch), name=f"batch {batch.id}")
                        self._drivers[batch.id] = task
                        task.add_done_callback(self._forget_driver)
                await self._woken()
        finally:
            drivers = [*self._drivers.values(), *([renewing] if renewing else [])]
            for task in drivers:
                task.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            await self._recorder.close()
            if self._shared:  # the lines this replica leaves go to another now, not after their claims
                try:
                    await self._db(BatchStore.release_claims)
                except Exception:
                    _log.exception("releasing the claims on batch lines failed: they run elsewhere after CLAIM_S")

    async def _woken(self) -> None:
        """Until :meth:`kick` or :meth:`cancel`; on a shared store at most ``poll_s`` (other replicas
        create and cancel batches too)."""
        if not self._shared:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._poll_s):
                await self._wake.wait()

    async def _renew_claims(self) -> None:
        while True:
            await asyncio.sleep(self._claim_s / 3)
            try:
                await self._db(BatchStore.renew_claims, now=time.time(), claim_s=self._claim_s)
            except Exception:
                _log.exception("renewing the claims on batch lines failed; tried again in %.0f s", self._claim_s / 3)

    def _forget_driver(self, task: asyncio.Task[None]) -> None:
        self._drivers = {bid: t for bid, t in self._drivers.items() if t is not task}

    async def _drive(self, batch: ActiveBatch) -> None:
        try:
            stop = self._stops.setdefault(batch.id, asyncio.Event())
            status = batch.status
            if status == "validating":
                status = await self._store(
                    BatchStore.validate, batch.id, accepts_model=self._accepts_model, now=self._now()
                )
            ending: Ending = "completed"
            if status == "in_progress":
                ending = await self._dispatch(batch, stop)
            if status in ("failed", "completed", "expired", "cancelled"):
                return
            if stop.is_set() or await self._store(BatchStore.status, batch.id) == "cancelling":
                ending = "cancelled"
            await self._store(BatchStore.finish, batch.id, ending, self._now())
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception("batch %s: the runner failed; it is retried on the next start", batch.id)
        finally:
            self._stops.pop(batch.id, None)
            self._resume_at.pop(batch.id, None)

    async def _dispatch(self, batch: ActiveBatch, stop: asyncio.Event) -> Ending:
        """Run the batch's lines until none is left unanswered, or it is cancelled or expired. On a
        shared store, lines other replicas claimed: wait for their results, or for their claims to
        run out (then run them here)."""
        expired: list[int] = []  # lines that waited out a "not now" past the window
        while True:
            ending = await self._dispatch_claimable(batch, stop, expired)
            if ending != "completed" or expired or stop.is_set() or not self._shared:
                break
            if await self._store(BatchStore.unanswered, batch.id) == 0:
                break
            if self._clock() >= batch.expires_at:
                ending = "expired"
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await stop.wait()
        return "expired" if expired and ending == "completed" else ending

    async def _dispatch_claimable(self, batch: ActiveBatch, stop: asyncio.Event, expired: list[int]) -> Ending:
        """Claim and start every line no other runner holds, within the slots, until done, cancelled
        or expired; wait for those running."""
        ending: Ending = "completed"
        after = 0
        async with asyncio.TaskGroup() as running:
            while ending == "completed" and not stop.is_set():
                lines = await self._store(
                    BatchStore.claim_lines,
                    batch.id,
                    after=after,
                    limit=self._claim_chunk if self._shared else CHUNK,
                    now=time.time(),
                    claim_s=self._claim_s,
                )
                if not lines:
                    break
                for line in lines:
                    slot = await self._next_slot(batch, stop)
                    if slot is None:
                        ending = "expired" if not stop.is_set() else ending
                        break
                    task = running.create_task(self._run_line(batch, line, stop, expired, slot))
                    task.add_done_callback(slot.given_back)  # also when it is cancelled before it runs
                    after = line.idx
        return ending

    async def _next_slot(self, batch: ActiveBatch, stop: asyncio.Event) -> _Slot | None:
        """A slot to start the batch's next line with, once no "not now" holds the batch; None: it was
        cancelled or its window ran out. A line told "not now" while this waited for the slot holds
        the batch again: the slot goes back until that has passed."""
        loop = asyncio.get_running_loop()
        while True:
            if not await self._after_not_now(batch, stop):
                return None
            await self._slots.acquire()
            slot = _Slot(self._slots)
            if stop.is_set() or self._clock() >= batch.expires_at:
                slot.give_back()
                return None
            if self._resume_at.get(batch.id, 0.0) <= loop.time():
                return slot
            slot.give_back()

    async def _after_not_now(self, batch: ActiveBatch, stop: asyncio.Event) -> bool:
        """Wait until the batch may start lines again (a "not now" told it when); False: it was
        cancelled or its window ran out meanwhile."""
        loop = asyncio.get_running_loop()
        while (wait := self._resume_at.get(batch.id, 0.0) - loop.time()) > 0:
            if self._clock() >= batch.expires_at:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(wait, max(batch.expires_at - self._clock(), 0.0))):
                    await stop.wait()
            if stop.is_set():
                return False
        return not stop.is_set() and self._clock() < batch.expires_at

    async def _run_line(
        self, batch: ActiveBatch, line: PendingLine, stop: asyncio.Event, expired: list[int], slot: _Slot
    ) -> None:
        """One line, holding the slot it was started with except while it waits out a "not now"
        (the batch starts no new line until that has passed). No result when it is withdrawn (the
        batch cancelled before it reached a worker) or its window ran out while it waited."""
        try:
            result = await self._answer(batch, line, stop, slot)
            if result is None:
                if not stop.is_set():
                    expired.append(line.idx)
                return
            outcome: Outcome
            usage = NO_USAGE
            if isinstance(result, Exception):
                outcome, text = (
                    "error",
                    error_line(
                        line.custom_id, code="internal_error", message=f"the request failed in the proxy: {result}"
                    ),
                )
            else:
                outcome = "output" if 200 <= result.status_code < 300 else "error"
                answer = parse_answer(result.body)
                text = output_line(
                    line.custom_id, status_code=result.status_code, request_id=result.request_id, answer=answer
                )
                usage = usage_of(answer)
            await self._recorder.record(Answered(batch.id, line.idx, outcome, text, usage))
        except Withdrawn:
            return
        finally:
            slot.give_back()

    async def _answer(
        self, batch: ActiveBatch, line: PendingLine, stop: asyncio.Event, slot: _Slot
    ) -> LineResult | Exception | None:
        """The executor's answer to the line, tried again after each "not now" (the slot given back
        meanwhile); the exception that failed it; None when the batch cannot wait any more for it
        (cancelled, or its window ran out). Raises :class:`Withdrawn`."""
        body = orjson.loads(line.body)
        while True:
            try:
                return await self._executor.execute(batch.endpoint, body, batch.owner, stop)
            except NotNow as later:
                resume = asyncio.get_running_loop().time() + later.retry_after_s
                self._resume_at[batch.id] = max(self._resume_at.get(batch.id, 0.0), resume)
                slot.give_back()
                if not await self._after_not_now(batch, stop):
                    return None
                await slot.take()
            except (asyncio.CancelledError, Withdrawn):
                raise
            except Exception as exc:
                _log.exception("batch %s line %d: the executor failed", batch.id, line.idx)
                return exc


async def riding_out(
    db: StoreThread, retry_s: float, method: Callable[Concatenate[BatchStore, P], T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """``db(method, ...)``, tried again every ``retry_s`` while the store's server cannot be reached
    (restarting, say): the runner carries on once it is back, its running lines kept."""
    while True:
        try:
            return await db(method, *args, **kwargs)
        except StoreUnavailable as exc:
            _log.warning("the batch store is unavailable, tried again in %.1f s: %s", retry_s, exc)
            await asyncio.sleep(retry_s)


class _Slot:
    """One of the runner's slots, held by a line (taken before it starts)."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots = slots
        self._held = True

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()

    def given_back(self, _done: asyncio.Task[None]) -> None:
        """The line's task is done (however it ended, even cancelled before its first step)."""
        self.give_back()

    async def take(self) -> None:
        await self._slots.acquire()
        self._held = True


class _Recorder:
    """Keeps the lines' results, those that arrive while one transaction commits all in the next one
    (a group commit: a line waits for its own result's commit, never for a timer)."""

    def __init__(self, db: StoreThread, retry_s: float) -> None:
        self._db = db
        self._retry_s = retry_s
        self._waiting: list[tuple[Answered, asyncio.Future[bool]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def record(self, answered: Answered) -> bool:
        """Once its transaction has committed: whether the result was kept (False: the line had one)."""
        kept: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((answered, kept))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="batch results")
        return await kept

    async def _write(self) -> None:
        while self._waiting:
            taken, self._waiting = self._waiting, []
            try:
                kept = await riding_out(
                    self._db, self._retry_s, BatchStore.record_many, [answered for answered, _ in taken]
                )
            except Exception as exc:
                for _, future in taken:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), was_kept in zip(taken, kept, strict=True):
                if not future.done():
                    future.set_result(was_kept)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
