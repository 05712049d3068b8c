"""One accepted request, from the proxy queue to its single answer.

    submit ──► wait for a worker (queue timeout → 503) ──► open upstream (until its first output)
                 ▲                                            │
                 └── requeue: retryable failure (bounded), ◄──┤
                     or taken back by the controller          ▼
                                           relay bytes to the client as they arrive

"Opening" covers everything before the client sees a byte: the POST, the response headers and,
for a stream, the first chunk (for a plain response, the whole body). Only failures in that phase
are retried (on another worker when one exists): connection refused or reset, a 5xx, a stream
that closed before any output. Once the first byte went to the client the request is committed:
an upstream failure then ends the stream with an error event.

The handler task is the only place that writes to the client, so a request is answered once. A
client that goes away cancels the handler (the app runs with ``handler_cancellation``): the
``finally`` clauses close the upstream connection (SGLang aborts a request whose client left),
POST ``/abort_request`` with the request's ``rid``, and release the worker slot. The controller's
take-back cancels the same task while the attempt has no output; the handler tells the two apart
by its cancel count (``Task.uncancel``) and requeues only a request taken back.

The upstream leg is :mod:`proxy.request.upstream` (its own HTTP/1.1 client): the open wakes the
handler once, when a stream's headers and first output are in, and after the first chunk the
rest of a stream is piped from the worker connection's callback to the client's socket.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson
from aiohttp import web

from proxy.request.admission import Priority, QueueFull
from proxy.request.dispatch import ProxyClosing, QueueTimeout
from proxy.errors import ApiError, error_event
from proxy.server.state import ProxyState
from proxy.request.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from proxy.server.validation import Job
from proxy.workers.base import WorkerState

_log = logging.getLogger(__name__)

_ABORT_HEADERS = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5)


class _EventStream(web.StreamResponse):
    """A stream whose headers leave with its first chunk (one write, one segment), as aiohttp's own
    ``Response`` sends them, instead of alone on ``prepare``."""

    _send_headers_immediately = False


class UpstreamFailure(Exception):
    """An attempt failed before any output reached the client."""

    def __init__(self, message: str, *, status: int = 502, retryable: bool = True,
                 body: bytes | None = None, content_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retryable = retryable
        self.body = body
        self.content_type = content_type


class Opened:
    """The outcome of opening an attempt: a whole answer, or a stream with its first chunk."""

    __slots__ = ("status", "content_type", "body", "resp", "first")

    def __init__(self, status: int, content_type: str, body: bytes | None,
                 resp: UpstreamResponse | None = None, first: bytes = b"") -> None:
        self.status = status
        self.content_type = content_type
        self.body = body
        self.resp = resp
        self.first = first


def _where(worker_id: str, url: str) -> str:
    return f"worker {worker_id} ({url})"


async def open_upstream(st: ProxyState, url: str, worker_id: str, job: Job, payload: bytes) -> Opened:
    assert st.upstream is not None
    timeout_s = st.policy.proxy.request_timeout_s
    where = _where(worker_id, url)
    resp: UpstreamResponse | None = None
    streaming = False
    try:
        resp = await st.upstream.post(url, job.path, payload, timeout_s=timeout_s, until_output=job.stream)
        if resp.status >= 500:
            body = await resp.read()
            raise UpstreamFailure(f"{where} answered HTTP {resp.status}: {body[:300].decode(errors='replace')}",
                                  status=resp.status, body=body, content_type=resp.content_type)
        if resp.status != 200 or not job.stream:
            return Opened(resp.status, resp.content_type, await resp.read())
        first = await resp.readany()
        if not first:
            raise UpstreamFailure(f"{where} ended the stream before any output")
        streaming = True
        return Opened(200, resp.content_type, None, resp, first)
    except UpstreamTimeout:
        raise UpstreamFailure(f"{where} did not answer within {timeout_s:g} s", status=504, retryable=False) from None
    except UpstreamError as exc:
        what = "is unreachable" if resp is None else "failed before any output"
        raise UpstreamFailure(f"{where} {what}: {exc}") from None
    finally:
        if resp is not None and not streaming:
            resp.close()  # read to the end: the connection goes back to the pool; otherwise it is closed


async def post_abort(st: ProxyState, url: str, rid: str) -> None:
    if st.session is None or st.session.closed:
        return
    try:
        async with st.session.post(url + "/abort_request", data=orjson.dumps({"rid": rid}),
                                   headers=_ABORT_HEADERS, timeout=_ABORT_TIMEOUT) as resp:
            await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        _log.debug("abort of %s at %s failed: %r", rid, url, exc)


def _closing_error(st: ProxyState) -> ApiError:
    return ApiError(503, "sglang-pacer is shutting down; the request was not started, send it again",
                    type="service_unavailable", code="shutting_down",
                    headers={"Retry-After": str(st.policy.queue.retry_after_s)})


def _no_worker_message(st: ProxyState) -> str:
    workers = st.pool.workers()
    ready = [w for w in workers if w.state is WorkerState.READY]
    waited = f"waited {st.policy.queue.timeout_s:g} s in the proxy queue (queue.timeout_s)"
    if not ready:
        states = ", ".join(f"{w.id} {w.state}" for w in workers) or "none configured"
        return f"no worker is ready ({states}); the request {waited}"
    return f"all {len(ready)} ready worker(s) stayed at their pacing limit; the request {waited}"


async def forward(st: ProxyState, request: web.Request, job: Job, priority: Priority,
                  arrived: float) -> web.StreamResponse:
    """Queue, dispatch, open, relay: the one answer to an accepted request.

    ``arrived`` is ``time.monotonic()`` when the handler started (for the added-latency metric).
    """
    d, m = st.dispatcher, st.metrics
    submitted = time.monotonic()
    try:
        ticket = d.submit(priority, st.policy.queue.timeout_s, job.affinity)
    except ProxyClosing:
        raise _closing_error(st) from None
    except QueueFull as exc:
        m.reject_full.inc()
        raise ApiError(429, f"{exc}; retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(st.policy.queue.retry_after_s)}) from None
    m.admitted.inc()
    user_rid = job.body.get("rid")
    base_rid = st.new_rid() if job.single and user_rid is None else None
    failures = 0
    tries = 0
    while True:
        try:
            attempt = await d.assigned(ticket)
        except ProxyClosing:
            raise _closing_error(st) from None
        except QueueTimeout:
            m.fail_timeout.inc()
            raise ApiError(503, _no_worker_message(st), type="service_unavailable", code="queue_timeout") from None
        if tries == 0:
            m.queue_time.observe(attempt.dispatched_at - ticket.enqueued_at)
        tries += 1
        if attempt.taken_back:  # the controller took it back before we even started
            d.release(attempt)
            m.requeued.inc()
            d.requeue(ticket)
            continue
        url = st.pool.get(attempt.worker_id).url
        rid = user_rid if user_rid is not None else (f"{base_rid}.{tries}" if base_rid else None)
        if rid is not None and base_rid is not None:
            job.body["rid"] = rid
        payload = orjson.dumps(job.body)
        if tries == 1:  # validation before the queue + wake-up and encoding after it
            m.added_latency.observe((submitted - arrived) + (time.monotonic() - attempt.dispatched_at))
        current = asyncio.current_task()
        assert current is not None
        d.start(attempt, current)  # take_back cancels this task while the attempt has no output yet
        try:
            opened = await open_upstream(st, url, attempt.worker_id, job, payload)
        except asyncio.CancelledError:
            d.release(attempt)
            if rid is not None:
                st.spawn(post_abort(st, url, rid))
            # taken back: one cancel came from the controller; any other is the client leaving
            if attempt.taken_back and current.uncancel() == 0:
                m.requeued.inc()
                d.requeue(ticket)
                continue
            m.disconnected.inc()
            raise
        except UpstreamFailure as fail:
            d.release(attempt)
            failures += 1
            if fail.retryable and failures < st.policy.pacing.max_attempts:
                _log.info("retrying request (attempt %d failed): %s", failures, fail.message)
                m.retried.inc()
                ticket.exclude = ticket.exclude | {attempt.worker_id}
                d.requeue(ticket)
                continue
            m.fail_upstream.inc()
            if fail.body and fail.content_type == "application/json":
                return web.Response(status=fail.status, body=fail.body, content_type="application/json")
            raise ApiError(fail.status if fail.status in (503, 504) else 502,
                           f"{fail.message} (after {failures} attempt(s))",
                           type="upstream_error", code="upstream_failed") from None
        except BaseException:
            d.release(attempt)
            raise
        d.mark_started(attempt)
        try:
            return await _respond(st, request, opened, url, rid)
        finally:
            d.release(attempt)


async def _respond(st: ProxyState, request: web.Request, opened: Opened, url: str,
                   rid: str | None) -> web.StreamResponse:
    m = st.metrics
    if opened.resp is None:
        m.completed.inc()
        return web.Response(status=opened.status, body=opened.body, content_type=opened.content_type or None)
    resp = opened.resp
    out = _EventStream(status=200, headers=_SSE_HEADERS)
    ok = False
    try:
        await out.prepare(request)
        await out.write(opened.first)  # the headers and the first chunk, in one segment
        transport = request.transport
        assert transport is not None
        high_water = transport.get_write_buffer_limits()[1]
        last = opened.first

        def sink(data: bytes) -> bool:
            # the rest of the stream goes from the worker's connection callback straight to the
            # client's socket, framed as HTTP chunks like aiohttp's own writer (which ends it below)
            nonlocal last
            if transport.is_closing():
                return False  # the client left: aiohttp cancels this handler next
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            last = data
            return transport.get_write_buffer_size() <= high_water

        resp.pipe(sink)
        while True:
            try:
                ended = await resp.piped()
            except UpstreamError as exc:
                m.fail_midstream.inc()
                _log.warning("worker stream broke after output was sent: %r", exc)
                sep = b"" if last.endswith(b"\n\n") else b"\n\n"
                await out.write(sep + error_event(
                    f"the worker failed mid-stream ({exc}); the answer is incomplete",
                    code="upstream_failed_mid_stream"))
                break
            if ended:
                m.completed.inc()
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
        if not ok and rid is not None:
            st.spawn(post_abort(st, url, rid))
