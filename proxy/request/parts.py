"""An answer in parts: one sent under its output budget and continued while a part stops at its cap
(:mod:`proxy.request.continuation`), one a worker ended early on a take-back and the next one goes on
from, and a stream whose worker broke mid-way that goes on from its text on the next attempt. Whole
answers are merged; a stream's parts are relayed as one stream (:mod:`proxy.request.stitch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from proxy.errors import error_event, reshape_error_events
from proxy.request import continuation
from proxy.request.admission import Priority
from proxy.request.attempt import Attempt, AttemptFailed, TakenBack, Ticket, WorkerLost
from proxy.request.continuation import Capped
from proxy.request.job import Job
from proxy.request.leg import (
    SSE_HEADERS,
    EventStream,
    Opened,
    Stitch,
    Upstream,
    is_interactive,
    mid_stream_error,
    next_cap,
    open_attempt,
    reached_budget,
    record_fact,
)
from proxy.request.path import RequestPath
from proxy.request.stitch import StreamStitcher
from proxy.request.upstream import UpstreamEnded, UpstreamError, UpstreamResponse, UpstreamTimeout

__all__ = [
    "Resume",
    "SentEvents",
    "broke",
    "capped_for",
    "counted_loss",
    "end_early",
    "fetch",
    "keep_what_it_wrote",
    "keeps_what_it_wrote",
    "respond_stitched",
    "resume_stream",
]

_log = logging.getLogger(__name__)


def capped_for(path: RequestPath, attempt: Attempt, job: Job) -> Capped | None:
    """How ``job`` goes to the attempt's worker under its output budget (None: as asked): the budget
    of the request's class, where the worker's engine reserves ``max_tokens`` and can continue."""
    load = path.board.get(attempt.worker_id)
    budget = load.output_budget(interactive=attempt.ticket.priority is Priority.INTERACTIVE, max_tokens=job.max_tokens)
    if budget is None:
        return None
    engine = path.engine_of(attempt.worker_id)
    if engine is None or not engine.reserves_max_tokens or engine.continuation_fields(job.path, job.body, 0) is None:
        return None
    return continuation.plan(job, budget)  # the budget applies to those asking for more than applies_above


TAKE_BACK_ANSWER_S = 10.0  # a worker asked to end a request early answers within this, else it is cancelled
# an early end's abort is posted again while the request runs on, after 0.25 s, then 0.5 s, then every
# second: an abort that reaches the engine before the request it names (read on another connection, not
# registered yet; a busy engine reads its connections late) finds nothing, SGLang's as the simulator's,
# and the request would run to its end on a worker waiting to restart
TAKE_BACK_ABORT_AGAIN_S = (0.25, 0.5, 1.0)


def keeps_what_it_wrote(path: RequestPath, worker_id: str, job: Job, upstream: Upstream) -> bool:
    """Whether a take-back of ``job`` from the worker can keep what it wrote: a plain whole request,
    with a name to end it by, on an engine that answers such an abort with the text so far and can
    continue it (:attr:`~proxy.engines.base.AbortByName.answers_with_output`)."""
    if upstream.name is None or upstream.by_name is None or not upstream.by_name.answers_with_output or job.stream:
        return False
    engine = path.engine_of(worker_id)
    if engine is None:
        return False
    return continuation.plain(job) is not None and engine.continuation_fields(job.path, job.body, 0) is not None


def end_early(path: RequestPath, attempt: Attempt, upstream: Upstream) -> None:
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
    path: RequestPath, attempt: Attempt, upstream: Upstream, name: str, k: int = 0, waited_s: float = 0.0
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


def keep_what_it_wrote(job: Job, opened: Opened, ticket: Ticket) -> None:
    """An attempt taken back while the worker wrote its whole answer: the worker ended it early and
    answered what it wrote, which the ticket keeps for the next attempt (:class:`TakenBack`). An answer
    that ended by itself before the abort arrived is the answer: nothing is raised."""
    part = continuation.read_part(job.path, opened.body or b"") if opened.status == 200 else None
    if part is not None and part.finish_reason != "abort":
        return
    ticket.written = (part,) if part is not None and part.completion_tokens > 0 else ()
    raise TakenBack()


async def fetch(
    path: RequestPath, attempt: Attempt, job: Job, capped: Capped | None, upstream: Upstream
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
                interactive=is_interactive(attempt),
            )  # fmt: skip
            if parts <= len(earlier):  # a part it could not continue: sent again whole, from the start
                attempt.going_on_from = 0
            return opened, parts, kept if capped is not None else None
    payload = orjson.dumps(job.body if capped is None else capped.body(job.body))
    opened = await open_attempt(path, upstream.url, worker_id, job, payload)
    if capped is None or opened.status != 200 or opened.body is None:
        return opened, 1, capped
    opened.body, parts, kept = await _continued(
        path, worker_id, job, capped, opened.body, upstream, base, interactive=is_interactive(attempt)
    )
    return opened, parts, kept


async def _continued(
    path: RequestPath,
    worker_id: str,
    job: Job,
    capped: Capped,
    first: bytes,
    upstream: Upstream,
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
            reached_budget(path, worker_id, interactive, capped)
        cap = next_cap(path, worker_id, interactive, capped, written)
        more = continuation.continuation_body(job.path, job.body, text, capped, cap, fields)
        upstream.part(more, base, f"c{len(parts)}")
        upstream.metrics.continued.inc()
        opened = await _part(path, upstream, worker_id, job, more)
        if opened.status != 200 or opened.body is None:
            return await _whole_again(path, worker_id, job, upstream, base), 1, None
        body = opened.body
    return (continuation.merge(job.path, parts) if len(parts) > 1 else first), len(parts), capped


async def _part(path: RequestPath, upstream: Upstream, worker_id: str, job: Job, body: dict[str, object]) -> Opened:
    """One more request of an attempt on its worker (``body``, named in ``upstream``); aborted there
    if this one is cancelled."""
    try:
        return await open_attempt(path, upstream.url, worker_id, job, orjson.dumps(body))
    except asyncio.CancelledError:
        upstream.abort(path)
        raise


async def _whole_again(path: RequestPath, worker_id: str, job: Job, upstream: Upstream, base: str | None) -> bytes:
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


async def respond_stitched(
    path: RequestPath,
    request: web.Request,
    opened: Opened,
    upstream: Upstream,
    headers: Mapping[str, str],
    plan: Stitch,
) -> web.StreamResponse:
    """A stream sent under its output budget, relayed as one stream however many parts it takes
    (:class:`~proxy.request.stitch.StreamStitcher`, :func:`_relay_parts`)."""
    stitcher = StreamStitcher(plan.job.path, client_usage=not opened.strip_usage)
    stitcher.begin_part()
    out = EventStream(status=200, headers={**SSE_HEADERS, **headers} if headers else SSE_HEADERS)
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
    upstream: Upstream,
    plan: Stitch,
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
                reached_budget(path, plan.worker_id, plan.interactive, capped)
            cap = next_cap(path, plan.worker_id, plan.interactive, capped, end.written)
            body = continuation.continuation_body(job.path, job.body, end.text, capped, cap, fields)
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            m.continued.inc()
            opened.parts += 1
            resp = await _post_part(path, upstream, job, body, base, f"c{opened.parts - 1}")
            stitcher.begin_part()
            chunk = await resp.readany()
        client_tail, opened.tail = stitcher.finish()
        await out.write(client_tail)
        m.completed.inc()
        await out.write_eof()
        ok = True
        return out
    except UpstreamError as exc:  # a part broke, or its continuation was refused twice, after output went out
        if not isinstance(exc, (UpstreamEnded, UpstreamTimeout)) and continuation.plain(job) is not None:
            ok = True  # its worker is gone, or refuses to go on: nothing to abort there
            what = "refused to continue it" if isinstance(exc, _Refused) else "broke"
            _log.warning("the worker of a stream %s after output was sent (%s): it goes on elsewhere", what, exc)
            raise WorkerLost(Resume(out, stitcher, plan, cap, losses)) from None
        m.fail_midstream.inc()
        await out.write(mid_stream_error(exc, "a stream sent under its output budget broke after output was sent"))
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


async def _post_part(
    path: RequestPath, upstream: Upstream, job: Job, body: dict[str, object], base: str | None, name: str
) -> UpstreamResponse:
    """Post a stream's next part (``body``, named ``name`` after ``base``) until its first output: a
    part the worker refuses is asked once more (a refusal may pass: a full queue, a request read late)
    before :class:`_Refused`, and then the stream goes on elsewhere."""
    assert path.upstream is not None
    refused = ""
    for again in ("", "r"):
        upstream.part(body, base, name + again)
        resp = await path.upstream.post(
            upstream.url, job.path, orjson.dumps(body), timeout_s=path.settings.request_timeout_s, until_output=True
        )
        if resp.status == 200:
            return resp
        refused = f"HTTP {resp.status}: {(await resp.read())[:300].decode(errors='replace')}"
        resp.close()
    raise _Refused(f"the answer could not be continued: {refused}")


@dataclass(slots=True)
class Resume:
    """A stream whose worker broke (or refused to go on) after output went out: its client response,
    what it has had (the stitcher's text), how it was sent (``plan``; ``cap``: the broken part's cap)
    and how many times a worker broke under it or refused to go on (``losses``)."""

    out: EventStream
    stitcher: StreamStitcher
    plan: Stitch
    cap: int
    losses: int

    async def fail(self, message: str, code: str | None) -> web.StreamResponse:
        """End the stream with an error event: the answer could not go on."""
        _log.warning("a stream whose worker broke could not go on: %s", message)
        await self.out.write(error_event(f"the answer is incomplete: {message}", code=code))
        await self.out.write_eof()
        return self.out


class SentEvents:
    """What a plain stream relayed as it came has sent (the worker's whole events), to go on from if its
    worker breaks: kept as it went, and read into a stitcher only past :attr:`KEPT_MAX` bytes (a long
    stream's memory stays bounded; most streams are never read: the plain relay pipes bytes unread)."""

    KEPT_MAX = 1 << 20
    __slots__ = ("_chunks", "_kept", "_stitcher")

    def __init__(self, path: str) -> None:
        self._chunks: list[bytes] = []
        self._kept = 0
        self._stitcher = StreamStitcher(path, client_usage=False)  # its text and events; the client's tail: later
        self._stitcher.begin_part()

    def add(self, data: bytes) -> None:
        self._chunks.append(data)
        self._kept += len(data)
        if self._kept > self.KEPT_MAX:
            self._read()

    def _read(self) -> None:
        self._stitcher.feed(b"".join(self._chunks))
        self._chunks.clear()
        self._kept = 0

    def stitcher(self, *, client_usage: bool) -> StreamStitcher:
        """Everything sent, read: the stitcher to go on with."""
        self._read()
        self._stitcher.client_usage = client_usage
        return self._stitcher


def broke(opened: Opened, plan: Stitch, out: EventStream, sent: SentEvents, exc: UpstreamError) -> Resume | None:
    """A plain stream relayed as it came whose worker broke: what it sent (``sent``), read into a
    stitcher to go on from. None when its finish event had gone out already."""
    stitcher = sent.stitcher(client_usage=not opened.strip_usage)
    if stitcher.ended:
        return None
    _log.warning("the worker of a stream broke after output was sent (%r): the answer goes on elsewhere", exc)
    return Resume(out, stitcher, plan, plan.capped.sent, 0)


def counted_loss(lost: WorkerLost, losses: int) -> Resume:
    """The state of a stream whose worker broke or refused to go on, its ``losses``-th time counted
    (past ``pacing.max_attempts``, the next attempt ends it with an error event)."""
    resume = lost.resume
    assert isinstance(resume, Resume)
    resume.losses = losses
    return resume


async def resume_stream(path: RequestPath, attempt: Attempt, upstream: Upstream, resume: Resume) -> web.StreamResponse:
    """The attempt after a stream's worker broke: the answer goes on from the text the client has,
    on this attempt's worker, into the same stream. Raises :class:`AttemptFailed` when the worker
    fails before output (the attempt's retry rules apply), :class:`WorkerLost` when it refuses twice
    or breaks again (the next attempt goes on)."""
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
    if resume.losses > path.dispatcher_for(job.model).max_attempts:  # pacing.max_attempts breaks or refusals
        return await resume.fail(f"it could not go on after {resume.losses} tries", "upstream_failed_mid_stream")
    engine = path.engine_of(worker_id)
    fields = None if engine is None else engine.continuation_fields(job.path, job.body, end.written)
    if fields is None:
        return await resume.fail(f"worker {worker_id} cannot continue it", "upstream_failed_mid_stream")
    budgeted = capped.sent < capped.asked
    cap = next_cap(path, worker_id, plan.interactive, capped, end.written) if budgeted else capped.asked - end.written
    body = continuation.continuation_body(job.path, job.body, end.text, capped, cap, fields)
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    base = upstream.name
    upstream.metrics.continued.inc()
    for again in ("", "r"):  # a refusal is asked once more here, then the stream goes on elsewhere
        upstream.part(body, base, "g" + again)
        opened = await open_attempt(path, upstream.url, worker_id, job, orjson.dumps(body))
        if opened.status == 200 and opened.resp is not None:
            break
        refused = (opened.body or b"")[:300].decode(errors="replace")
        _log.warning("worker %s refused to continue a stream: HTTP %d: %s", worker_id, opened.status, refused)
    else:
        raise WorkerLost(resume)
    attempt.mark_started()
    attempt.going_on_from = end.written
    stitcher.begin_part()
    here = Stitch(job, capped, worker_id, plan.interactive)
    out = await _relay_parts(path, resume.out, opened, upstream, here, stitcher, cap, resume.losses)
    record_fact(path, job, opened, attempt, attempt.ticket.enqueued_at, capped if budgeted else None, opened.parts)
    return out
