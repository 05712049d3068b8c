"""One attempt's leg to its worker: opening it until its first output, the client's event stream, the
request open on the worker (named, abortable), the error event that ends a broken stream, and the
facts an answered request leaves. :mod:`proxy.request.relay` and :mod:`proxy.request.parts` share it.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from proxy.engines.base import AbortByName
from proxy.errors import error_event
from proxy.request.admission import Priority
from proxy.request.attempt import Attempt, AttemptFailed
from proxy.request.continuation import Capped
from proxy.request.dispatch import ProxyClosing
from proxy.request.facts import RequestFact, read_usage, usage_of_stream
from proxy.request.job import Job
from proxy.request.path import RequestMetrics, RequestPath
from proxy.request.sse import has_output
from proxy.request.upstream import (
    UpstreamEnded,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = [
    "SSE_HEADERS",
    "EventStream",
    "Opened",
    "Stitch",
    "Upstream",
    "is_interactive",
    "mid_stream_error",
    "next_cap",
    "open_attempt",
    "post_abort",
    "reached_budget",
    "record_fact",
]

_log = logging.getLogger(__name__)

_ABORT_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5)


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
        self.stitch: Stitch | None = None  # a stream sent under its output budget: how to go on
        self.parts = 1  # the answer's parts (more than one: it reached its output budget and went on)
        self.go_on: Stitch | None = None  # a plain stream, relayed as it comes: how it goes on if its worker breaks


async def open_attempt(path: RequestPath, url: str, worker_id: str, job: Job, payload: bytes) -> Opened:
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


async def post_abort(path: RequestPath, url: str, by_name: AbortByName, name: str) -> None:
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


@dataclass(slots=True)
class Upstream:
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
            path.spawn(post_abort(path, self.url, self.by_name, name))


def record_fact(
    path: RequestPath, job: Job, opened: Opened, attempt: Attempt, queued: float, capped: Capped | None, parts: int
) -> None:
    """One answered request's facts into its worker's ring (one parse of the body or the stream's tail)."""
    dispatched = attempt.dispatched_at
    cached: int | None = None
    if opened.resp is None:
        prompt, output, reason, cached = (
            read_usage(opened.body or b"") if opened.status == 200 else (None, None, None, None)
        )
        ttft = None  # a whole answer: its first token is not seen
    else:
        prompt, output, reason, cached = usage_of_stream(opened.tail)
        ttft = opened.opened_at - dispatched
    path.board.get(attempt.worker_id).facts.record(
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
            prefix_key=None if job.affinity is None else zlib.crc32(job.affinity.encode()),
            cached_tokens=cached,
        )
    )


def mid_stream_error(exc: UpstreamError, what: str) -> bytes:
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


def is_interactive(attempt: Attempt) -> bool:
    return attempt.ticket.priority is Priority.INTERACTIVE


def reached_budget(path: RequestPath, worker_id: str, interactive: bool, capped: Capped) -> None:
    """An answer's first part wrote all its output budget allowed: the budget's overrun, noted now
    (:mod:`proxy.request.budgets`), not once the answer ends."""
    path.board.get(worker_id).output_budgets.note_reached((interactive, capped.asked), time.monotonic())


def next_cap(path: RequestPath, worker_id: str, interactive: bool, capped: Capped, written: int) -> int:
    """What an answer's next part may write, under the worker's budget for its kind as it is now: a
    budget lifted meanwhile (the answers got longer) lets it write the rest in one part."""
    budget = path.board.get(worker_id).output_budget(interactive=interactive, max_tokens=capped.asked)
    return capped.next_cap(written, capped.asked if budget is None else budget)


@dataclass(frozen=True, slots=True)
class Stitch:
    """A stream sent under its output budget: the request, its cap and its worker, to go on from."""

    job: Job
    capped: Capped
    worker_id: str
    interactive: bool  # the class it was sent as: its budget's
