"""One accepted request, from the proxy queue to its single answer.

    submit ──► wait for a worker (queue timeout → 503) ──► open upstream (until its first output)
                 ▲                                            │
                 └── requeue: no output sent, and a retry  ◄──┤
                     left, the worker unreachable, or taken   ▼
                     back by the controller        relay bytes to the client as they arrive

"Opening" covers everything before the client sees a byte: the POST, the response headers and,
for a stream, its first content (:mod:`proxy.request.sse`: a chat stream's opening role event is
held back until content follows; for a plain response, the whole body). Only failures in that
phase are retried (on another worker when one exists): a 5xx, a reset, a stream that closed
before any content. A refused connection reports the worker to the pool (which stops sending to
it) and puts the request back in the queue without spending one of its attempts. Once output went
to the client the request is committed: an upstream failure then ends the stream with an error
event.

The attempt's lifecycle (release, requeue) is :meth:`proxy.request.dispatch.Dispatcher.attempt`'s;
this module opens, relays and answers. The handler task is the only place that writes to the
client, so a request is answered once. A client that goes away cancels the handler (the app runs
with ``handler_cancellation``): the upstream connection is closed (SGLang aborts a request whose
client left) and, on an engine that aborts a request by name (the contract's ``abort_by_name``:
SGLang's ``/abort_request`` with its ``rid``), the abort is posted too.

Errors, in this layer: exceptions. Opening raises :class:`~proxy.request.attempt.AttemptFailed`
(consumed by the attempt's block); :func:`forward` raises :class:`~proxy.errors.ApiError` for
every refusal and returns the response otherwise; so does :func:`complete`, the same loop for a
request no client streams from (a batch line), which returns the whole answer.

The upstream leg is :mod:`proxy.request.upstream` (its own HTTP/1.1 client): the open wakes the
handler once, when a stream's headers and first output are in, and after the first chunk the
rest of a stream is piped from the worker connection's callback to the client's socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import aiohttp
import orjson
from aiohttp import web

from proxy.engines.base import AbortByName
from proxy.errors import ApiError, error_event, openai_error_body, reshape_error_events
from proxy.request import continuation
from proxy.request.admission import BYTES_PER_TOKEN, Priority, QueueFull, estimate_cost
from proxy.request.attempt import Attempt, AttemptFailed, TakenBack, Ticket, WorkerLost
from proxy.request.continuation import Capped
from proxy.request.dispatch import Dispatcher, NoWorker, ProxyClosing, QueueTimeout, worker_words
from proxy.request.facts import RequestFact, read_usage, strip_usage, usage_of_stream
from proxy.request.job import Job
from proxy.request.limits import RateLimited
from proxy.request.path import RequestMetrics, RequestPath
from proxy.request.sse import has_output
from proxy.request.stitch import StreamStitcher, WholeEvents
from proxy.request.upstream import (
    UpstreamEnded,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.workers.base import WorkerState

__all__ = ["EventStream", "Opened", "complete", "forward"]

R = TypeVar("R", bound=web.StreamResponse)

_log = logging.getLogger(__name__)

_ABORT_HEADERS = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5)
_NO_FIELDS: Mapping[str, object] = {}
_NO_HEADERS: Mapping[str, str] = {}


class EventStream(web.StreamResponse):
    """A stream whose headers leave with its first chunk (one write, one segment), as aiohttp's own
    ``Response`` sends them, instead of alone on ``prepare``.

    aiohttp has no public switch for this; its ``Response`` sets the class attribute below. The
    attribute exists in the aiohttp versions ``pyproject.toml`` allows, and a test fails if it
    disappears or stops having this effect.
    """

    _send_headers_immediately = False


class Opened:
    """The outcome of opening an attempt: a whole answer, or a stream with its first output."""

    __slots__ = (
        "body",
        "content_type",
        "first",
        "go_on",
        "opened_at",
        "parts",
        "resp",
        "status",
        "stitch",
        "strip_usage",
        "tail",
    )

    def __init__(
        self,
        status: int,
        content_type: str,
        body: bytes | None,
        resp: UpstreamResponse | None = None,
        first: bytes = b"",
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.body = body
        self.resp = resp
        self.first = first
        self.tail = b""  # a stream's last chunks as the worker sent them (its usage), set once relayed
        self.strip_usage = False  # the proxy asked for the stream's usage event: keep it from the client
        self.opened_at = time.monotonic()  # its first output (a stream) or its whole answer arrived
        self.stitch: _Stitch | None = None  # a stream sent under its output budget: how to go on
        self.parts = 1  # the answer's parts (more than one: it reached its output budget and went on)
        self.go_on: _Stitch | None = None  # a plain stream, relayed as it comes: how it goes on if its worker breaks


async def _open(path: RequestPath, url: str, worker_id: str, job: Job, payload: bytes) -> Opened:
    """POST to the worker and read until output; raises :class:`AttemptFailed` if none came."""
    assert path.upstream is not None
    timeout_s = path.settings.request_timeout_s
    where = f"worker {worker_id} ({url})"
    resp: UpstreamResponse | None = None
    streaming = False
    try:
        resp = await path.upstream.post(url, job.path, payload, timeout_s=timeout_s, until_output=job.stream)
        if resp.status >= 500:
            body = await resp.read()
            raise AttemptFailed(
                f"{where} answered HTTP {resp.status}: {body[:300].decode(errors='replace')}",
                status=resp.status,
                body=body,
                content_type=resp.content_type,
            )
        if resp.status != 200 or not job.stream:
            return Opened(resp.status, resp.content_type, await resp.read())
        first = await resp.readany()
        while first and not has_output(first):  # only the opening role event yet: wait for content
            more = await resp.readany()
            if not more:
                break
            first += more
        if not has_output(first):
            raise AttemptFailed(f"{where} ended the stream before any output")
        streaming = True
        return Opened(200, resp.content_type, None, resp, first)
    except UpstreamTimeout:
        raise AttemptFailed(f"{where} did not answer within {timeout_s:g} s", status=504, retryable=False) from None
    except UpstreamUnreachable as exc:
        raise AttemptFailed(f"{where} is unreachable: {exc}", unreachable=True) from None
    except UpstreamEnded:  # the proxy is shutting down: no output went out, the client sends it again
        raise ProxyClosing() from None
    except UpstreamError as exc:
        if await path.upstream.refuses(url):  # it broke as its worker died: wait for a live one, no try spent
            raise AttemptFailed(f"{where} went away before any output: {exc}", gone=True) from None
        raise AttemptFailed(f"{where} failed before any output: {exc}") from None
    finally:
        if resp is not None and not streaming:
            resp.close()  # read to the end: the connection goes back to the pool; otherwise it is closed


async def _post_abort(path: RequestPath, url: str, by_name: AbortByName, name: str) -> None:
    session = path.session
    if session is None or session.closed:
        return
    try:
        async with session.post(
            url + by_name.path, data=orjson.dumps(by_name.body(name)), headers=_ABORT_HEADERS, timeout=_ABORT_TIMEOUT
        ) as resp:
            await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        _log.debug("abort of %s at %s failed: %r", name, url, exc)


def _come_back(path: RequestPath) -> dict[str, str]:
    """The ``Retry-After`` of the proxy's own "not now" answers (``queue.retry_after_s``)."""
    return {"Retry-After": str(path.settings.retry_after_s)}


def _queue_full_error(path: RequestPath, exc: QueueFull) -> ApiError:
    """429 ``queue_full``: the queue was full as the request came, or it was pushed out of it."""
    return ApiError(429, f"{exc}; retry later", type="rate_limit_error", code="queue_full", headers=_come_back(path))


def _closing_error(path: RequestPath) -> ApiError:
    return ApiError(
        503,
        "sglang-pacer is shutting down and did not answer the request; send it again",
        type="service_unavailable",
        code="shutting_down",
        headers=_come_back(path),
    )


def _none_will_serve_error(path: RequestPath, exc: NoWorker) -> ApiError:
    """503 ``no_worker``: every worker of the model is down for good (the policy revives none: no
    ``Retry-After``, only an operator brings one back) or in a crash loop (``Retry-After``: the
    controller revives it, and it may start)."""
    headers = None if exc.for_good else _come_back(path)
    return ApiError(503, str(exc), type="service_unavailable", code="no_worker", headers=headers)


def _no_worker_message(path: RequestPath, dispatcher: Dispatcher) -> str:
    """Why a request of ``dispatcher``'s pool waited out its queue timeout: that pool's workers' states
    (:func:`~proxy.request.dispatch.worker_words`) or their pacing limits."""
    workers = dispatcher.pool.workers()
    ready = [w for w in workers if w.state is WorkerState.READY]
    waited = f"waited {path.settings.queue_timeout_s:g} s in the proxy queue (queue.timeout_s)"
    if not ready:
        states = ", ".join(worker_words(w) for w in workers)
        return f"no worker is ready ({states or 'none configured'}); the request {waited}"
    return f"all {len(ready)} ready worker(s) stayed at their pacing limit; the request {waited}"


def _failure_error(fail: AttemptFailed, attempts: int) -> ApiError:
    """Ours, for a request whose last attempt failed before output: 504 ``upstream_timeout`` when
    the worker was too slow, else 502 (503 as the worker said it) ``upstream_failed``."""
    message = f"{fail.message} (after {attempts} attempt(s))"
    if fail.status == 504:
        return ApiError(504, message, type="upstream_error", code="upstream_timeout")
    return ApiError(503 if fail.status == 503 else 502, message, type="upstream_error", code="upstream_failed")


async def forward(
    path: RequestPath, request: web.Request, job: Job, priority: Priority, arrived: float, key: str = ""
) -> web.StreamResponse:
    """Queue, dispatch, open, relay: the one answer to an accepted request of ``key`` (a key's name).

    ``arrived`` is ``time.monotonic()`` when the handler started (for the added-latency metric).
    """
    return await _answer(path, job, priority, arrived, partial(_respond, path, request), key)


async def complete(path: RequestPath, job: Job, priority: Priority, key: str = "") -> web.Response:
    """The whole answer to a request that no client streams from (a batch line): queued, dispatched,
    retried and refused (:class:`~proxy.errors.ApiError`) as :func:`forward` does."""
    if job.stream:
        raise ValueError("a streamed request needs a client to stream to: forward it")

    async def whole(opened: Opened, upstream: _Upstream, _headers: Mapping[str, str]) -> web.Response:
        return _whole(upstream.metrics, opened)

    answer = await _answer(path, job, priority, time.monotonic(), whole, key)
    assert isinstance(answer, web.Response)  # no stream: nothing went out before its answer
    return answer


async def _answer(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, _Upstream, Mapping[str, str]], Awaitable[R]],
    key: str,
) -> R | web.StreamResponse:
    """The queue-and-attempt loop of :func:`forward` and :func:`complete`; ``respond`` answers an
    opened attempt (while it holds its worker). The key's limits hold the request from here to its end."""
    submitted = time.monotonic()
    cost = estimate_cost(job.size, job.max_tokens, path.settings.default_max_tokens, job.choices)
    try:
        lease = path.limits.acquire(key, cost, submitted)
    except RateLimited as exc:
        path.metrics.reject_rate_limited.inc()
        raise ApiError(
            429, exc.message, type="rate_limit_error", code="rate_limit_exceeded", headers=exc.headers
        ) from None
    try:
        headers = lease.headers

        def respond_with_limits(opened: Opened, upstream: _Upstream) -> Awaitable[R]:
            return respond(opened, upstream, headers)

        return await _queued(path, job, priority, arrived, respond_with_limits, key, cost, submitted)
    finally:
        lease.release()


async def _queued(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, _Upstream], Awaitable[R]],
    key: str,
    cost: int,
    submitted: float,
) -> R | web.StreamResponse:
    d, m = path.dispatcher_for(job.model), path.metrics_for(job.model)
    try:
        ticket = d.submit(
            priority,
            path.settings.queue_timeout_s,
            job.affinity,
            key=key,
            cost=cost,
            prompt_tokens=job.size // BYTES_PER_TOKEN,
            max_tokens=job.max_tokens,
        )
    except ProxyClosing:
        raise _closing_error(path) from None
    except NoWorker as exc:
        m.reject_no_worker.inc()
        raise _none_will_serve_error(path, exc) from None
    except QueueFull as exc:
        m.reject_full.inc()
        raise _queue_full_error(path, exc) from None
    m.admitted.inc()
    box = _Resumed()
    try:
        return await _attempts(path, job, priority, arrived, respond, submitted, ticket, box)
    except ApiError as err:
        if box.resume is None:
            raise
        return await box.resume.fail(err.message, err.code)  # the stream went out: its end is an error event


@dataclass(slots=True)
class _Resumed:
    """The stream of a request whose worker broke after output went out (None: none broke)."""

    resume: _Resume | None = None


async def _attempts(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, _Upstream], Awaitable[R]],
    submitted: float,
    ticket: Ticket,
    box: _Resumed,
) -> R | web.Response | web.StreamResponse:
    """The attempts of an admitted request until one answers it (the module docstring's loop); a
    stream whose worker broke mid-way goes on, on the next attempt, from the text it sent (``box``)."""
    d, m = path.dispatcher_for(job.model), path.metrics_for(job.model)
    strip = _ask_for_usage(job)
    named: _Named | None = None  # how the job's attempts are named on its workers, once one is chosen
    tries = 0
    sent_fields: Mapping[str, object] = _NO_FIELDS
    while True:
        placed = False  # the client left while its ticket waited for a worker: counted here
        try:
            async with d.attempt(ticket) as attempt:
                placed = job.on_worker = True
                attempt.streamed = job.stream
                if tries == 0:
                    m.queue_time.observe(attempt.dispatched_at - ticket.enqueued_at)
                tries += 1
                url = path.pool.get(attempt.worker_id).url
                fields = path.priority_fields(attempt.worker_id, interactive=priority is Priority.INTERACTIVE)
                if fields is not sent_fields:  # the worker orders its own queue by class (or no longer does)
                    for name in sent_fields:
                        job.body.pop(name, None)
                    job.body.update(fields)
                    sent_fields = fields
                engine = path.engine_of(attempt.worker_id)
                by_name = engine.abort_by_name if engine is not None else None
                named = named or _Named.of(path, job, by_name)
                upstream = _Upstream(url, by_name, named.attempt(job, tries), m)
                capped = _capped(path, attempt, job)
                attempt.sent_max_tokens = None if capped is None else capped.sent
                if tries == 1:  # validation before the queue + wake-up and encoding after it
                    m.added_latency.observe((submitted - arrived) + (time.monotonic() - attempt.dispatched_at))
                if box.resume is not None:  # its worker broke mid-stream: the answer goes on here
                    try:
                        return await _go_on(path, attempt, upstream, box.resume)
                    except WorkerLost as lost:
                        box.resume = _lost(lost, box.resume.losses + 1)
                        raise
                    except asyncio.CancelledError:
                        upstream.abort(path)
                        if not attempt.taken_back:
                            m.disconnected.inc()
                        raise
                if _keeps_what_it_wrote(path, attempt.worker_id, job, upstream):
                    attempt.on_take_back = partial(_end_early, path, attempt, upstream)
                try:
                    opened, parts, capped = await _fetch(path, attempt, job, capped, upstream)
                except asyncio.CancelledError:  # taken back, or the client left: abort it on the worker
                    upstream.abort(path)
                    if not attempt.taken_back:
                        m.disconnected.inc()
                    raise
                finally:
                    attempt.on_take_back = None
                if attempt.taken_back and opened.resp is None:  # a whole answer the worker ended early
                    _keep_what_it_wrote(job, opened, ticket)  # what it wrote goes with the ticket
                attempt.mark_started()
                opened.strip_usage = strip
                opened.parts = parts
                whole = capped or continuation.plain(job)
                if opened.resp is not None and whole is not None:  # a stream that can go on past a cap or a break
                    plan = _Stitch(job, whole, attempt.worker_id, _interactive(attempt))
                    opened.stitch, opened.go_on = (plan, None) if capped is not None else (None, plan)
                try:
                    answer = await respond(opened, upstream)
                except WorkerLost as lost:
                    box.resume = _lost(lost, 1)
                    raise
                _record_fact(path, job, opened, attempt, ticket.enqueued_at, capped, opened.parts)
                return answer
        except asyncio.CancelledError:
            if not placed:  # once placed, the fetch and the relay count a client that leaves
                m.disconnected.inc()
            raise
        except ProxyClosing:
            raise _closing_error(path) from None
        except NoWorker as exc:
            m.fail_no_worker.inc()
            raise _none_will_serve_error(path, exc) from None
        except QueueFull as exc:  # pushed out of the full queue by another key's request
            m.fail_pushed_out.inc()
            raise _queue_full_error(path, exc) from None
        except QueueTimeout:
            m.fail_timeout.inc()
            raise ApiError(
                503,
                _no_worker_message(path, d),
                type="service_unavailable",
                code="queue_timeout",
                headers=_come_back(path),
            ) from None
        except AttemptFailed as fail:
            m.fail_upstream.inc()
            if box.resume is None and fail.body and fail.content_type == "application/json":  # the worker's own
                return web.Response(
                    status=fail.status, body=openai_error_body(fail.status, fail.body), content_type="application/json"
                )
            raise _failure_error(fail, ticket.failures) from None
        finally:
            job.on_worker = False
        # the attempt ended without output and the ticket is back in the queue: wait for the next


def _capped(path: RequestPath, attempt: Attempt, job: Job) -> Capped | None:
    """How ``job`` goes to the attempt's worker under its output budget (None: as asked): the budget
    of the request's class, where the worker's engine reserves ``max_tokens`` and can continue."""
    load = path.dispatcher.board.get(attempt.worker_id)
    budget = load.output_budget(interactive=attempt.ticket.priority is Priority.INTERACTIVE, max_tokens=job.max_tokens)
    if budget is None:
        return None
    engine = path.engine_of(attempt.worker_id)
    if engine is None or not engine.reserves_max_tokens or engine.continuation_fields(job.path, job.body, 0) is None:
        return None
    return continuation.plan(job, budget)  # the budget applies to those asking for more than applies_above


@dataclass(frozen=True, slots=True)
class _Named:
    """How a job's attempts are named on workers that abort by name: the client's own name (kept as
    it is, one for all), or the proxy's id of a single-prompt job (its ``x-request-id``), numbered
    per attempt (``.1``, ``.2``, ...) and per part (``.1.c1``); ``base`` None: its attempts go unnamed."""

    field: str | None  # the body field that names a request on the job's workers
    given: str | None  # the client's own name in that field
    base: str | None  # the proxy's name for the job

    @classmethod
    def of(cls, path: RequestPath, job: Job, by_name: AbortByName | None) -> _Named:
        if by_name is None:
            return cls(None, None, None)
        given = job.body.get(by_name.field)
        if given is not None:  # as the client sent it (a list names a batch of prompts: not aborted by one)
            return cls(by_name.field, given if isinstance(given, str) else None, None)
        return cls(by_name.field, None, (job.request_id or path.new_rid()) if job.single else None)

    def attempt(self, job: Job, tries: int) -> str | None:
        """The name of the job's ``tries``-th attempt, set in its body (None: unnamed)."""
        if self.base is None or self.field is None:
            job.upstream_name = self.given
        else:
            job.upstream_name = job.body[self.field] = f"{self.base}.{tries}"
        return job.upstream_name


@dataclass(slots=True)
class _Upstream:
    """The request an attempt has open on its worker now: the worker's URL, how a request is aborted
    there by name, the name the one open now was sent under (each part has its own; None: unnamed),
    and what is counted of its pool's requests."""

    url: str
    by_name: AbortByName | None
    name: str | None
    metrics: RequestMetrics

    def part(self, body: dict[str, object], base: str | None, suffix: str) -> None:
        """``body`` is the attempt's next request: its name is ``base`` with ``suffix``."""
        if base is not None and self.by_name is not None:
            self.name = body[self.by_name.field] = f"{base}.{suffix}"

    def abort(self, path: RequestPath, name: str | None = None) -> None:
        """Abort the request open now on the worker (or the one sent under ``name``), if it has a name
        to abort it by."""
        name = name or self.name
        if name is not None and self.by_name is not None:
            path.spawn(_post_abort(path, self.url, self.by_name, name))


TAKE_BACK_ANSWER_S = 10.0  # a worker asked to end a request early answers within this, else it is cancelled
# an early end's abort is posted again while the request runs on, after 0.25 s, then 0.5 s, then every
# second: an abort that reaches the engine before the request it names (read on another connection, not
# registered yet; a busy engine reads its connections late) finds nothing, SGLang's as the simulator's,
# and the request would run to its end on a worker waiting to restart
TAKE_BACK_ABORT_AGAIN_S = (0.25, 0.5, 1.0)


def _keeps_what_it_wrote(path: RequestPath, worker_id: str, job: Job, upstream: _Upstream) -> bool:
    """Whether a take-back of ``job`` from the worker can keep what it wrote: a plain whole request,
    with a name to end it by, on an engine that answers such an abort with the text so far and can
    continue it (:attr:`~proxy.engines.base.AbortByName.answers_with_output`)."""
    if upstream.name is None or upstream.by_name is None or not upstream.by_name.answers_with_output or job.stream:
        return False
    engine = path.engine_of(worker_id)
    if engine is None:
        return False
    return continuation.plain(job) is not None and engine.continuation_fields(job.path, job.body, 0) is not None


def _end_early(path: RequestPath, attempt: Attempt, upstream: _Upstream) -> None:
    """A take-back of a whole answer the worker can end early: abort the request there, and it answers
    with what it wrote (the attempt's block then ends with :class:`TakenBack`). One that does not
    answer within ``TAKE_BACK_ANSWER_S`` is cancelled, as any take-back."""
    if upstream.name is not None:
        upstream.abort(path)
        _abort_again(path, attempt, upstream, upstream.name)

    def late() -> None:
        if not attempt.released and attempt.task is not None:
            attempt.task.cancel()

    asyncio.get_running_loop().call_later(TAKE_BACK_ANSWER_S, late)


def _abort_again(
    path: RequestPath, attempt: Attempt, upstream: _Upstream, name: str, k: int = 0, waited_s: float = 0.0
) -> None:
    """Post the abort of the request sent under ``name`` again after the ``k``-th pause of
    ``TAKE_BACK_ABORT_AGAIN_S`` (its last one over and over) while the attempt is open, until
    ``TAKE_BACK_ANSWER_S`` (when it is cancelled): an engine answers an abort of a request it has not
    registered yet with nothing done."""
    pause = TAKE_BACK_ABORT_AGAIN_S[min(k, len(TAKE_BACK_ABORT_AGAIN_S) - 1)]
    if waited_s + pause >= TAKE_BACK_ANSWER_S:
        return

    def again() -> None:
        if attempt.released or path.session is None or path.session.closed:
            return
        _log.debug("abort of %s at %s still open after %g s: sent again", name, upstream.url, waited_s + pause)
        upstream.abort(path, name)
        _abort_again(path, attempt, upstream, name, k + 1, waited_s + pause)

    asyncio.get_running_loop().call_later(pause, again)


def _keep_what_it_wrote(job: Job, opened: Opened, ticket: Ticket) -> None:
    """An attempt taken back while the worker wrote its whole answer: the worker ended it early and
    answered what it wrote, which the ticket keeps for the next attempt (:class:`TakenBack`). An answer
    that ended by itself before the abort arrived is the answer: nothing is raised."""
    part = continuation.read_part(job.path, opened.body or b"") if opened.status == 200 else None
    if part is not None and part.finish_reason != "abort":
        return
    ticket.written = (part,) if part is not None and part.completion_tokens > 0 else ()
    raise TakenBack()


async def _fetch(
    path: RequestPath, attempt: Attempt, job: Job, capped: Capped | None, upstream: _Upstream
) -> tuple[Opened, int, Capped | None]:
    """The attempt's answer from its worker, its number of parts and the cap it went under: the
    request as the client sent it or under its output budget (``capped``), continued while a part
    stops at its cap (:func:`_continued`); or, when an earlier worker had written part of it before
    it was taken back (``ticket.written``), going on from that text (``attempt.going_on_from``)."""
    base, worker_id, ticket = upstream.name, attempt.worker_id, attempt.ticket
    earlier, ticket.written = ticket.written, ()
    engine = path.engine_of(worker_id)
    whole = capped or continuation.plain(job)
    if earlier and whole is not None and engine is not None:
        written = sum(p.completion_tokens for p in earlier)
        fields = engine.continuation_fields(job.path, job.body, written)
        if fields is not None:
            cap = whole.next_cap(written, whole.sent)
            more = continuation.continuation_body(job.path, job.body, "".join(p.text for p in earlier), whole, cap,
                                                  fields)  # fmt: skip
            upstream.part(more, base, "r")
            attempt.going_on_from = written
            opened = await _part(path, upstream, worker_id, job, more)
            if opened.status != 200 or opened.body is None:  # refused: as the client asked, from the start
                attempt.going_on_from = 0
                opened.body, opened.status = await _whole_again(path, worker_id, job, upstream, base), 200
                return opened, 1, None
            opened.body, parts, kept = await _continued(
                path, worker_id, job, whole, opened.body, upstream, base, earlier=earlier, cap=cap,
                interactive=_interactive(attempt),
            )  # fmt: skip
            if parts <= len(earlier):  # a part it could not continue: sent again whole, from the start
                attempt.going_on_from = 0
            return opened, parts, kept if capped is not None else None
    payload = orjson.dumps(job.body if capped is None else capped.body(job.body))
    opened = await _open(path, upstream.url, worker_id, job, payload)
    if capped is None or opened.status != 200 or opened.body is None:
        return opened, 1, capped
    opened.body, parts, kept = await _continued(
        path, worker_id, job, capped, opened.body, upstream, base, interactive=_interactive(attempt)
    )
    return opened, parts, kept


async def _continued(
    path: RequestPath,
    worker_id: str,
    job: Job,
    capped: Capped,
    first: bytes,
    upstream: _Upstream,
    base: str | None,
    *,
    interactive: bool,
    earlier: tuple[continuation.Part, ...] = (),
    cap: int | None = None,
) -> tuple[bytes, int, Capped | None]:
    """The whole answer of a request sent under its output budget, its number of parts and its cap
    (None when it was sent again whole): while a
    part ends at its cap before the client's ``max_tokens``, the next part continues it on the same
    worker (:mod:`proxy.request.continuation`). A part that cannot be continued (not one plain choice
    with its usage, or a refusal) sends the request again whole, as the client asked: nothing is cut
    short. Raises :class:`AttemptFailed` when a part fails (the attempt's retry rules apply)."""
    engine = path.engine_of(worker_id)
    body: bytes = first
    parts: list[continuation.Part] = list(earlier)
    written = sum(p.completion_tokens for p in earlier)
    text = "".join(p.text for p in earlier)
    cap = capped.sent if cap is None else cap
    while True:
        part = continuation.read_part(job.path, body)
        if part is None or engine is None:
            return await _whole_again(path, worker_id, job, upstream, base), 1, None
        parts.append(part)
        written += part.completion_tokens
        text += part.text
        # it ended by itself, at the client's max_tokens, or at a limit of the engine's own (its context)
        if part.finish_reason != "length" or written >= capped.asked or part.completion_tokens < cap:
            break
        fields = engine.continuation_fields(job.path, job.body, written)
        if fields is None:
            return await _whole_again(path, worker_id, job, upstream, base), 1, None
        if len(parts) == 1:
            _reached_budget(path, worker_id, interactive, capped)
        cap = _next_cap(path, worker_id, interactive, capped, written)
        more = continuation.continuation_body(job.path, job.body, text, capped, cap, fields)
        upstream.part(more, base, f"c{len(parts)}")
        upstream.metrics.continued.inc()
        opened = await _part(path, upstream, worker_id, job, more)
        if opened.status != 200 or opened.body is None:
            return await _whole_again(path, worker_id, job, upstream, base), 1, None
        body = opened.body
    return (continuation.merge(job.path, parts) if len(parts) > 1 else first), len(parts), capped


async def _part(path: RequestPath, upstream: _Upstream, worker_id: str, job: Job, body: dict[str, object]) -> Opened:
    """One more request of an attempt on its worker (``body``, named in ``upstream``); aborted there
    if this one is cancelled."""
    try:
        return await _open(path, upstream.url, worker_id, job, orjson.dumps(body))
    except asyncio.CancelledError:
        upstream.abort(path)
        raise


async def _whole_again(path: RequestPath, worker_id: str, job: Job, upstream: _Upstream, base: str | None) -> bytes:
    """The request sent again as the client asked (its own ``max_tokens``): the answer, or the
    worker's refusal as it answered."""
    upstream.metrics.budget_redone.inc()
    body = dict(job.body)
    upstream.part(body, base, "w")
    opened = await _part(path, upstream, worker_id, job, body)
    if opened.status != 200:
        raise AttemptFailed(
            f"worker {worker_id} ({upstream.url}) refused the request sent again whole: HTTP {opened.status}",
            status=opened.status,
            body=opened.body,
            content_type=opened.content_type,
            retryable=False,
        )
    return opened.body or b""


_USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")


def _ask_for_usage(job: Job) -> bool:
    """Ask a stream for its usage event; True when the client did not ask (strip it from the relay)."""
    if not job.stream or job.path not in _USAGE_PATHS:
        return False
    options = job.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    job.body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return True


def _record_fact(
    path: RequestPath, job: Job, opened: Opened, attempt: Attempt, queued: float, capped: Capped | None, parts: int
) -> None:
    """One answered request's facts into its worker's ring (one parse of the body or the stream's tail)."""
    dispatched = attempt.dispatched_at
    if opened.resp is None:
        prompt, output, reason = read_usage(opened.body or b"") if opened.status == 200 else (None, None, None)
        ttft = None  # a whole answer: its first token is not seen
    else:
        prompt, output, reason = usage_of_stream(opened.tail)
        ttft = opened.opened_at - dispatched
    path.dispatcher.board.get(attempt.worker_id).facts.record(
        RequestFact(
            time=time.monotonic(),
            arrived=queued,
            prompt_tokens=prompt,
            output_tokens=output,
            max_tokens=job.max_tokens,
            finish_reason=reason,
            ttft_s=ttft,
            queue_s=max(0.0, dispatched - queued),
            interactive=attempt.ticket.priority is Priority.INTERACTIVE,
            sent_max_tokens=None if capped is None else capped.sent,
            parts=parts,
            written_before=attempt.going_on_from,
        )
    )


def _whole(m: RequestMetrics, opened: Opened, headers: Mapping[str, str] = _NO_HEADERS) -> web.Response:
    """A whole answer; a worker's refusal (not 200) in OpenAI's error shape, its status and message
    kept. ``headers``: the key's rate-limit headers, on a successful answer."""
    m.completed.inc()
    if opened.status != 200 and opened.body is not None:
        return web.Response(
            status=opened.status, body=openai_error_body(opened.status, opened.body), content_type="application/json"
        )
    return web.Response(
        status=opened.status, body=opened.body, content_type=opened.content_type or None, headers=headers or None
    )


async def _respond(
    path: RequestPath,
    request: web.Request,
    opened: Opened,
    upstream: _Upstream,
    headers: Mapping[str, str] = _NO_HEADERS,
) -> web.StreamResponse:
    m = upstream.metrics
    if opened.resp is None:
        return _whole(upstream.metrics, opened, headers)
    if opened.stitch is not None:
        return await _respond_stitched(path, request, opened, upstream, headers, opened.stitch)
    resp = opened.resp
    out = EventStream(status=200, headers={**_SSE_HEADERS, **headers} if headers else _SSE_HEADERS)
    ok = False
    try:
        await out.prepare(request)
        strip = opened.strip_usage
        whole = WholeEvents()  # the usage and error events are read and rewritten whole, however they arrive
        earlier = (b"", b"")  # the two pieces before the latest: the finish reason, usage and [DONE] may come apart
        sent: list[bytes] | None = [] if opened.go_on is not None else None  # a plain stream's, to go on from

        def client_bytes(data: bytes) -> bytes:
            """What of the worker's bytes goes to the client now: whole events, rewritten."""
            nonlocal earlier
            data = whole.feed(data)
            if not data:
                return data
            if sent is not None:
                sent.append(data)
            earlier, opened.tail = (earlier[1], opened.tail), data
            if strip:
                data = strip_usage(data)
            return reshape_error_events(data)  # a worker's error event, in OpenAI's shape

        last = client_bytes(opened.first)
        await out.write(last)  # the headers and the first output, in one segment
        transport = request.transport
        assert transport is not None
        high_water = transport.get_write_buffer_limits()[1]

        def sink(data: bytes) -> bool:
            # the rest of the stream goes from the worker's connection callback straight to the
            # client's socket, framed as HTTP chunks like aiohttp's own writer (which ends it below)
            nonlocal last
            if transport.is_closing():
                return False  # the client left: aiohttp cancels this handler next
            data = client_bytes(data)
            if not data:  # nothing whole to send (an empty chunk would end the response)
                return True
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            last = data
            return transport.get_write_buffer_size() <= high_water

        resp.pipe(sink)
        while True:
            try:
                ended = await resp.piped()
            except UpstreamError as exc:
                if opened.go_on is not None and sent is not None and not isinstance(exc, UpstreamEnded):
                    if (resume := _broke(opened, opened.go_on, out, b"".join(sent), exc)) is not None:
                        raise WorkerLost(resume) from None
                    m.completed.inc()  # it broke after its finish event: the client has the whole answer
                    await out.write(b"data: [DONE]\n\n")
                    break
                m.fail_midstream.inc()
                sep = b"" if last.endswith(b"\n\n") else b"\n\n"
                await out.write(sep + _mid_stream_error(exc, "worker stream broke after output was sent"))
                break
            if ended:
                m.completed.inc()
                rest = whole.rest()  # a stream that ended without its last boundary: rewritten as the rest
                opened.tail = b"".join((*earlier, opened.tail, rest))
                if rest:
                    await out.write(reshape_error_events(strip_usage(rest) if strip else rest))
                break
            await request.writer.drain()  # the client is slow: wait until its socket buffer drained
            resp.resume_pipe()
        await out.write_eof()
        ok = True
        return out
    except (ConnectionResetError, asyncio.CancelledError):
        m.disconnected.inc()
        raise
    finally:
        resp.close()
        if not ok:
            upstream.abort(path)


def _mid_stream_error(exc: UpstreamError, what: str) -> bytes:
    """The error event that ends a stream whose worker leg broke after output went out (logged), or
    that the proxy ended as it shut down (counted in its shutdown's log line instead)."""
    if isinstance(exc, UpstreamEnded):
        return error_event(
            "sglang-pacer is shutting down; the answer is incomplete", type="service_unavailable", code="shutting_down"
        )
    _log.warning("%s: %r", what, exc)
    return error_event(
        f"the worker failed mid-stream ({exc}); the answer is incomplete", code="upstream_failed_mid_stream"
    )


def _interactive(attempt: Attempt) -> bool:
    return attempt.ticket.priority is Priority.INTERACTIVE


def _reached_budget(path: RequestPath, worker_id: str, interactive: bool, capped: Capped) -> None:
    """An answer's first part wrote all its output budget allowed: the budget's overrun, noted now
    (:mod:`proxy.request.budgets`), not once the answer ends."""
    path.dispatcher.board.get(worker_id).output_budgets.note_reached((interactive, capped.asked), time.monotonic())


def _next_cap(path: RequestPath, worker_id: str, interactive: bool, capped: Capped, written: int) -> int:
    """What an answer's next part may write, under the worker's budget for its kind as it is now: a
    budget lifted meanwhile (the answers got longer) lets it write the rest in one part."""
    budget = path.dispatcher.board.get(worker_id).output_budget(interactive=interactive, max_tokens=capped.asked)
    return capped.next_cap(written, capped.asked if budget is None else budget)


@dataclass(frozen=True, slots=True)
class _Stitch:
    """A stream sent under its output budget: the request, its cap and its worker, to go on from."""

    job: Job
    capped: Capped
    worker_id: str
    interactive: bool  # the class it was sent as: its budget's


async def _respond_stitched(
    path: RequestPath,
    request: web.Request,
    opened: Opened,
    upstream: _Upstream,
    headers: Mapping[str, str],
    plan: _Stitch,
) -> web.StreamResponse:
    """A stream sent under its output budget, relayed as one stream however many parts it takes
    (:class:`~proxy.request.stitch.StreamStitcher`, :func:`_relay_parts`)."""
    stitcher = StreamStitcher(plan.job.path, client_usage=not opened.strip_usage)
    stitcher.begin_part()
    out = EventStream(status=200, headers={**_SSE_HEADERS, **headers} if headers else _SSE_HEADERS)
    try:
        await out.prepare(request)
    except BaseException:
        if opened.resp is not None:
            opened.resp.close()
        upstream.abort(path)
        raise
    return await _relay_parts(path, out, opened, upstream, plan, stitcher, plan.capped.sent)


class _Refused(UpstreamError):
    """The worker refused to continue an answer (its HTTP status and words)."""


async def _relay_parts(
    path: RequestPath,
    out: EventStream,
    opened: Opened,
    upstream: _Upstream,
    plan: _Stitch,
    stitcher: StreamStitcher,
    cap: int,
    losses: int = 0,
) -> web.StreamResponse:
    """Relay a stitched stream's parts into ``out`` from ``opened``'s: while a part stops at its cap
    (``cap``) before the client's ``max_tokens``, the next part continues it on the same worker. A
    worker that breaks mid-part raises :class:`WorkerLost` (the answer goes on from its text on the
    next attempt, ``losses`` counts the breaks so far); a continuation it refuses ends the stream with
    an error event, as does the proxy's own shutdown. Each event is read here (the plain relay pipes
    bytes unread)."""
    m = upstream.metrics
    job, capped = plan.job, plan.capped
    engine = path.engine_of(plan.worker_id)
    resp = opened.resp
    assert resp is not None
    base, ok = upstream.name, False
    try:
        chunk = opened.first
        while True:
            while chunk:
                data = stitcher.feed(chunk)
                if data:
                    await out.write(reshape_error_events(data))
                chunk = await resp.readany()
            resp.close()
            end = stitcher.end_part()
            done = (
                end.reason != "length"
                or end.part_written is None
                or end.part_written < cap
                or end.written >= capped.asked
            )
            fields = None if done or engine is None else engine.continuation_fields(job.path, job.body, end.written)
            if fields is None:
                break
            if opened.parts == 1:
                _reached_budget(path, plan.worker_id, plan.interactive, capped)
            cap = _next_cap(path, plan.worker_id, plan.interactive, capped, end.written)
            body = continuation.continuation_body(job.path, job.body, end.text, capped, cap, fields)
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            upstream.part(body, base, f"c{opened.parts}")
            m.continued.inc()
            opened.parts += 1
            resp = await path.upstream.post(  # type: ignore[union-attr]
                upstream.url, job.path, orjson.dumps(body), timeout_s=path.settings.request_timeout_s, until_output=True
            )
            if resp.status != 200:
                refused = (await resp.read())[:300].decode(errors="replace")
                raise _Refused(f"the answer could not be continued: HTTP {resp.status}: {refused}")
            stitcher.begin_part()
            chunk = await resp.readany()
        client_tail, opened.tail = stitcher.finish()
        await out.write(client_tail)
        m.completed.inc()
        await out.write_eof()
        ok = True
        return out
    except UpstreamError as exc:  # a part broke, or its continuation was refused, after output went out
        if not isinstance(exc, (_Refused, UpstreamEnded, UpstreamTimeout)) and continuation.plain(job) is not None:
            ok = True  # its worker is gone: nothing to abort there
            _log.warning("the worker of a stream broke after output was sent (%r): the answer goes on elsewhere", exc)
            raise WorkerLost(_Resume(out, stitcher, plan, cap, losses)) from None
        m.fail_midstream.inc()
        await out.write(_mid_stream_error(exc, "a stream sent under its output budget broke after output was sent"))
        await out.write_eof()
        ok = True
        return out
    except (ConnectionResetError, asyncio.CancelledError):
        m.disconnected.inc()
        raise
    finally:
        resp.close()
        if not ok:
            upstream.abort(path)


@dataclass(slots=True)
class _Resume:
    """A stream whose worker broke after output went out: its client response, what it has had (the
    stitcher's text), how it was sent (``plan``; ``cap``: the broken part's cap) and how many times a
    worker broke under it."""

    out: EventStream
    stitcher: StreamStitcher
    plan: _Stitch
    cap: int
    losses: int

    async def fail(self, message: str, code: str | None) -> web.StreamResponse:
        """End the stream with an error event: the answer could not go on."""
        _log.warning("a stream whose worker broke could not go on: %s", message)
        await self.out.write(error_event(f"the answer is incomplete: {message}", code=code))
        await self.out.write_eof()
        return self.out


def _broke(opened: Opened, plan: _Stitch, out: EventStream, sent: bytes, exc: UpstreamError) -> _Resume | None:
    """A plain stream relayed as it came whose worker broke: what it sent (``sent``, the worker's
    events), read into a stitcher to go on from. None when its finish event had gone out already."""
    stitcher = StreamStitcher(plan.job.path, client_usage=not opened.strip_usage)
    stitcher.begin_part()
    stitcher.feed(sent)
    if stitcher.ended:
        return None
    _log.warning("the worker of a stream broke after output was sent (%r): the answer goes on elsewhere", exc)
    return _Resume(out, stitcher, plan, plan.capped.sent, 0)


def _lost(lost: WorkerLost, losses: int) -> _Resume:
    """The state of a stream whose worker broke, its ``losses``-th break counted (past
    ``pacing.max_attempts``, the next attempt ends it with an error event)."""
    resume = lost.resume
    assert isinstance(resume, _Resume)
    resume.losses = losses
    return resume


async def _go_on(path: RequestPath, attempt: Attempt, upstream: _Upstream, resume: _Resume) -> web.StreamResponse:
    """The attempt after a stream's worker broke: the answer goes on from the text the client has,
    on this attempt's worker, into the same stream. Raises :class:`AttemptFailed` when the worker
    fails before output (the attempt's retry rules apply)."""
    plan, stitcher = resume.plan, resume.stitcher
    job, capped, worker_id = plan.job, plan.capped, attempt.worker_id
    end = stitcher.end_broken()
    if end.written >= capped.asked or (
        end.reason is not None and (end.reason != "length" or capped.sent >= capped.asked)
    ):
        client_tail, _ = stitcher.finish()  # it had ended: the finish event came before the break
        await resume.out.write(client_tail)
        await resume.out.write_eof()
        upstream.metrics.completed.inc()
        return resume.out
    if resume.losses > path.dispatcher_for(job.model).max_attempts:
        return await resume.fail(f"its worker broke {resume.losses} times", "upstream_failed_mid_stream")
    engine = path.engine_of(worker_id)
    fields = None if engine is None else engine.continuation_fields(job.path, job.body, end.written)
    if fields is None:
        return await resume.fail(f"worker {worker_id} cannot continue it", "upstream_failed_mid_stream")
    budgeted = capped.sent < capped.asked
    cap = _next_cap(path, worker_id, plan.interactive, capped, end.written) if budgeted else capped.asked - end.written
    body = continuation.continuation_body(job.path, job.body, end.text, capped, cap, fields)
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    upstream.part(body, upstream.name, "g")
    upstream.metrics.continued.inc()
    opened = await _open(path, upstream.url, worker_id, job, orjson.dumps(body))
    if opened.status != 200 or opened.resp is None:
        refused = (opened.body or b"")[:300].decode(errors="replace")
        return await resume.fail(f"worker {worker_id} refused to continue it: HTTP {opened.status}: {refused}",
                                 "upstream_failed_mid_stream")  # fmt: skip
    attempt.mark_started()
    attempt.going_on_from = end.written
    stitcher.begin_part()
    here = _Stitch(job, capped, worker_id, plan.interactive)
    out = await _relay_parts(path, resume.out, opened, upstream, here, stitcher, cap, resume.losses)
    _record_fact(path, job, opened, attempt, attempt.ticket.enqueued_at, capped if budgeted else None, opened.parts)
    return out
