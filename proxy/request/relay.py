"""One accepted request, from the proxy queue to its single answer.

    submit ──► wait for a worker (queue timeout → 503) ──► open upstream (until its first output)
                 ▲                                            │
                 └── requeue: no output sent, and a retry  ◄──┤
                     left, the worker unreachable, or taken   ▼
                     back by the controller        relay bytes to the client as they arrive

"Opening" is everything before the client sees a byte: the POST, the headers and, for a stream,
its first content (:mod:`proxy.request.sse`). Only failures then are retried, on another worker
when one exists; a refused connection reports the worker to the pool and requeues without
spending an attempt. Once output went out the request is committed: when its worker breaks
mid-stream, a plain request goes on from the text the client has, on another worker or the revived
one, in the same stream (:class:`~proxy.request.attempt.WorkerLost`); any other stream ends with
an error event. The handler task is the only writer to the client, so a request is answered once;
a client that goes away cancels it, and the upstream request is closed and, where the engine
aborts by name, aborted. Refusals are :class:`~proxy.errors.ApiError`; :func:`complete` is the
same loop for a request no client streams from (a batch line).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from aiohttp import web

from proxy.engines.base import AbortByName
from proxy.errors import ApiError, openai_error_body, reshape_error_events
from proxy.request import continuation
from proxy.request.admission import BYTES_PER_TOKEN, Priority, QueueFull, estimate_cost
from proxy.request.attempt import Attempt, AttemptFailed, Ticket, WorkerLost
from proxy.request.dispatch import Dispatcher, NoWorker, ProxyClosing, QueueTimeout, worker_words
from proxy.request.facts import strip_usage
from proxy.request.job import Job
from proxy.request.leg import (
    SSE_HEADERS,
    EventStream,
    Opened,
    Stitch,
    Upstream,
    is_interactive,
    mid_stream_error,
    record_fact,
)
from proxy.request.limits import RateLimited
from proxy.request.parts import (
    Resume,
    SentEvents,
    broke,
    capped_for,
    counted_loss,
    end_early,
    fetch,
    keep_what_it_wrote,
    keeps_what_it_wrote,
    respond_stitched,
    resume_stream,
)
from proxy.request.path import RequestMetrics, RequestPath
from proxy.request.stitch import WholeEvents
from proxy.request.upstream import (
    UpstreamEnded,
    UpstreamError,
)
from proxy.workers.base import WorkerState

__all__ = ["EventStream", "Opened", "complete", "forward"]

R = TypeVar("R", bound=web.StreamResponse)
T = TypeVar("T")

_log = logging.getLogger(__name__)

_NO_FIELDS: Mapping[str, object] = {}
_NO_HEADERS: Mapping[str, str] = {}


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

    async def whole(opened: Opened, upstream: Upstream, _headers: Mapping[str, str]) -> web.Response:
        return _whole(upstream.metrics, opened)

    answer = await _answer(path, job, priority, time.monotonic(), whole, key)
    assert isinstance(answer, web.Response)  # no stream: nothing went out before its answer
    return answer


async def _answer(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, Upstream, Mapping[str, str]], Awaitable[R]],
    key: str,
) -> R | web.StreamResponse:
    """The queue-and-attempt loop of :func:`forward` and :func:`complete`; ``respond`` answers an
    opened attempt (while it holds its worker). The key's limits hold the request from here to its end."""
    submitted = time.monotonic()
    cost = estimate_cost(job.size, job.max_tokens, path.settings.default_max_tokens, job.choices)
    try:
        lease = await path.limits.admit(key, cost, submitted)
    except RateLimited as exc:
        path.metrics_for(job.model).reject_rate_limited.inc()
        raise ApiError(
            429, exc.message, type="rate_limit_error", code="rate_limit_exceeded", headers=exc.headers
        ) from None
    try:
        headers = lease.headers

        def respond_with_limits(opened: Opened, upstream: Upstream) -> Awaitable[R]:
            return respond(opened, upstream, headers)

        return await _queued(path, job, priority, arrived, respond_with_limits, key, cost, submitted)
    finally:
        lease.release()


async def _queued(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, Upstream], Awaitable[R]],
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

    resume: Resume | None = None


async def _attempts(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, Upstream], Awaitable[R]],
    submitted: float,
    ticket: Ticket,
    box: _Resumed,
) -> R | web.Response | web.StreamResponse:
    """The attempts of an admitted request until one answers it (the module docstring's loop); a
    stream whose worker broke mid-way goes on, on the next attempt, from the text it sent (``box``)."""
    d, m = path.dispatcher_for(job.model), path.metrics_for(job.model)
    tries = _Tries(strip=_ask_for_usage(job))
    while True:
        placed = False  # the client left while its ticket waited for a worker: counted here
        try:
            async with d.attempt(ticket) as attempt:
                placed = job.on_worker = True
                return await _attempt(path, job, priority, arrived, respond, submitted, ticket, box, attempt, tries)
        except asyncio.CancelledError:
            if not placed:  # once placed, the fetch and the relay count a client that leaves
                m.disconnected.inc()
            raise
        except (ProxyClosing, NoWorker, QueueFull, QueueTimeout, AttemptFailed) as exc:
            answer = _failed(path, d, m, exc, ticket, box)
            if isinstance(answer, ApiError):
                raise answer from None
            return answer
        finally:
            job.on_worker = False
        # the attempt ended without output and the ticket is back in the queue: wait for the next


@dataclass(slots=True)
class _Tries:
    """What a request's attempts carry from one to the next."""

    strip: bool  # strip the usage event from a stream (the client did not ask for it)
    count: int = 0  # attempts placed on a worker so far
    named: _Named | None = None  # how the job's attempts are named on its workers, once one is chosen
    sent_fields: Mapping[str, object] = field(default_factory=lambda: _NO_FIELDS)  # the priority fields in the body now


def _failed(
    path: RequestPath,
    d: Dispatcher,
    m: RequestMetrics,
    exc: ProxyClosing | NoWorker | QueueFull | QueueTimeout | AttemptFailed,
    ticket: Ticket,
    box: _Resumed,
) -> ApiError | web.Response:
    """The one table from why a request got no answer to what the client gets: a refusal to raise,
    or a worker's own error answer to relay as it is."""
    if isinstance(exc, ProxyClosing):
        return _closing_error(path)
    if isinstance(exc, NoWorker):
        m.fail_no_worker.inc()
        return _none_will_serve_error(path, exc)
    if isinstance(exc, QueueFull):  # pushed out of the full queue by another key's request
        m.fail_pushed_out.inc()
        return _queue_full_error(path, exc)
    if isinstance(exc, QueueTimeout):
        m.fail_timeout.inc()
        return ApiError(
            503, _no_worker_message(path, d), type="service_unavailable", code="queue_timeout", headers=_come_back(path)
        )
    m.fail_upstream.inc()
    if box.resume is None and exc.body and exc.content_type == "application/json":  # the worker's own
        return web.Response(
            status=exc.status, body=openai_error_body(exc.status, exc.body), content_type="application/json"
        )
    return _failure_error(exc, ticket.failures)


def _upstream(path: RequestPath, job: Job, priority: Priority, attempt: Attempt, tries: _Tries) -> Upstream:
    """The attempt's leg to its worker, the job's body set for it: the worker's priority fields and
    the attempt's name."""
    fields = path.priority_fields(attempt.worker_id, interactive=priority is Priority.INTERACTIVE)
    if fields is not tries.sent_fields:  # the worker orders its own queue by class (or no longer does)
        for name in tries.sent_fields:
            job.body.pop(name, None)
        job.body.update(fields)
        tries.sent_fields = fields
    engine = path.engine_of(attempt.worker_id)
    by_name = engine.abort_by_name if engine is not None else None
    tries.named = tries.named or _Named.of(path, job, by_name)
    url = path.pool.get(attempt.worker_id).url
    return Upstream(url, by_name, tries.named.attempt(job, tries.count), path.metrics_for(job.model))


async def _attempt(
    path: RequestPath,
    job: Job,
    priority: Priority,
    arrived: float,
    respond: Callable[[Opened, Upstream], Awaitable[R]],
    submitted: float,
    ticket: Ticket,
    box: _Resumed,
    attempt: Attempt,
    tries: _Tries,
) -> R | web.StreamResponse:
    """One attempt on the worker it was placed on: open it (or go on with a stream whose worker
    broke), then answer while it holds the worker."""
    m = path.metrics_for(job.model)
    attempt.streamed = job.stream
    if tries.count == 0:
        m.queue_time.observe(attempt.dispatched_at - ticket.enqueued_at)
    tries.count += 1
    upstream = _upstream(path, job, priority, attempt, tries)
    capped = capped_for(path, attempt, job)
    attempt.sent_max_tokens = None if capped is None else capped.sent
    if tries.count == 1:  # validation before the queue + wake-up and encoding after it
        m.added_latency.observe((submitted - arrived) + (time.monotonic() - attempt.dispatched_at))
    if box.resume is not None:  # its worker broke mid-stream: the answer goes on here
        try:
            return await _aborted_if_cancelled(
                path, attempt, upstream, resume_stream(path, attempt, upstream, box.resume)
            )
        except WorkerLost as lost:
            box.resume = counted_loss(lost, box.resume.losses + 1)
            raise
    if keeps_what_it_wrote(path, attempt.worker_id, job, upstream):
        attempt.on_take_back = partial(end_early, path, attempt, upstream)
    try:
        opened, parts, capped = await _aborted_if_cancelled(
            path, attempt, upstream, fetch(path, attempt, job, capped, upstream)
        )
    finally:
        attempt.on_take_back = None
    if attempt.taken_back and opened.resp is None:  # a whole answer the worker ended early
        keep_what_it_wrote(job, opened, ticket)  # what it wrote goes with the ticket
    attempt.mark_started()
    opened.strip_usage = tries.strip
    opened.parts = parts
    whole = capped or continuation.plain(job)
    if opened.resp is not None and whole is not None:  # a stream that can go on past a cap or a break
        plan = Stitch(job, whole, attempt.worker_id, is_interactive(attempt))
        opened.stitch, opened.go_on = (plan, None) if capped is not None else (None, plan)
    try:
        answer = await respond(opened, upstream)
    except WorkerLost as lost:
        box.resume = counted_loss(lost, 1)
        raise
    record_fact(path, job, opened, attempt, ticket.enqueued_at, capped, opened.parts)
    return answer


async def _aborted_if_cancelled(path: RequestPath, attempt: Attempt, upstream: Upstream, opening: Awaitable[T]) -> T:
    """``opening``, with the upstream request aborted on the worker when it is cancelled (taken back,
    or the client left; the client leaving is counted)."""
    try:
        return await opening
    except asyncio.CancelledError:
        upstream.abort(path)
        if not attempt.taken_back:
            upstream.metrics.disconnected.inc()
        raise


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
    upstream: Upstream,
    headers: Mapping[str, str] = _NO_HEADERS,
) -> web.StreamResponse:
    """The client's answer to an opened attempt: whole, stitched from parts, or a stream relayed."""
    if opened.resp is None:
        return _whole(upstream.metrics, opened, headers)
    if opened.stitch is not None:
        return await respond_stitched(path, request, opened, upstream, headers, opened.stitch)
    return await _relay_stream(path, request, opened, upstream, headers)


class _ClientBytes:
    """What of a worker's stream goes to the client: whole events (the usage and error events are read
    and rewritten whole, however they arrive), the usage event stripped when the client did not ask
    for it, and a worker's error event in OpenAI's shape. Keeps the stream's tail on ``opened``."""

    __slots__ = ("earlier", "opened", "sent", "strip", "whole")

    def __init__(self, opened: Opened) -> None:
        self.opened = opened
        self.strip = opened.strip_usage
        self.whole = WholeEvents()
        self.earlier = (
            b"",
            b"",
        )  # the two pieces before the latest: the finish reason, usage and [DONE] may come apart
        self.sent = SentEvents(opened.go_on.job.path) if opened.go_on is not None else None  # to go on from

    def __call__(self, data: bytes) -> bytes:
        data = self.whole.feed(data)
        if not data:
            return data
        if self.sent is not None:
            self.sent.add(data)
        self.earlier, self.opened.tail = (self.earlier[1], self.opened.tail), data
        if self.strip:
            data = strip_usage(data)
        return reshape_error_events(data)  # a worker's error event, in OpenAI's shape

    def rest(self) -> bytes:
        """At the end of the stream: what it ended with, past its last boundary, rewritten."""
        rest = self.whole.rest()
        self.opened.tail = b"".join((*self.earlier, self.opened.tail, rest))
        return reshape_error_events(strip_usage(rest) if self.strip else rest) if rest else b""


async def _relay_stream(
    path: RequestPath, request: web.Request, opened: Opened, upstream: Upstream, headers: Mapping[str, str]
) -> web.StreamResponse:
    """A plain stream, relayed as it arrives: from the worker's connection callback straight to the
    client's socket; one whose worker breaks goes on elsewhere when it can (:class:`WorkerLost`)."""
    m = upstream.metrics
    resp = opened.resp
    assert resp is not None
    out = EventStream(status=200, headers={**SSE_HEADERS, **headers} if headers else SSE_HEADERS)
    ok = False
    try:
        await out.prepare(request)
        client_bytes = _ClientBytes(opened)
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
                await _broke_mid_stream(opened, out, client_bytes.sent, exc, last, m)
                break
            if ended:
                m.completed.inc()
                if rest := client_bytes.rest():  # a stream that ended without its last boundary
                    await out.write(rest)
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


async def _broke_mid_stream(
    opened: Opened, out: EventStream, sent: SentEvents | None, exc: UpstreamError, last: bytes, m: RequestMetrics
) -> None:
    """The worker's stream broke after output went out: a plain request goes on elsewhere from the
    text the client has (raises :class:`WorkerLost`), one that had its finish event ends as it is,
    and any other ends with an error event."""
    if opened.go_on is not None and sent is not None and not isinstance(exc, UpstreamEnded):
        if (resume := broke(opened, opened.go_on, out, sent, exc)) is not None:
            raise WorkerLost(resume) from None
        m.completed.inc()  # it broke after its finish event: the client has the whole answer
        await out.write(b"data: [DONE]\n\n")
        return
    m.fail_midstream.inc()
    sep = b"" if last.endswith(b"\n\n") else b"\n\n"
    await out.write(sep + mid_stream_error(exc, "worker stream broke after output was sent"))
