"""The proxy's HTTP/1.1 client for its workers: the request path's one upstream leg.

    pool = UpstreamPool()
    resp = await pool.post("http://127.0.0.1:30000", "/v1/completions", body, timeout_s=600)
    chunk = await resp.readany()        # b"" at the end; raises UpstreamError if the worker broke
    resp.close()                        # finished: back to the pool; unfinished: the connection closes

Why not aiohttp's client: a relayed stream is one ``readany`` per token, and a general client pays
per request for cookies, redirects, hooks and timer contexts, and per chunk for a StreamReader.
This one does what the relay needs: a keep-alive connection per request in flight, reused per
worker newest first; answers parsed by ``httptools`` (llhttp) and handed over as they arrive; one
deadline timer per request; back-pressure past ``high_water`` unread bytes, so a slow client slows
the worker's stream instead of filling memory.

A failure is never retried here: only the relay knows whether the worker may have started the
request. :meth:`UpstreamResponse.close` on an unfinished answer closes its connection (SGLang aborts
such a request); :meth:`UpstreamResponse.abort` fails the reader first (the deadline, and the
shutdown's :meth:`UpstreamPool.end_in_flight`). Errors: :class:`UpstreamError`, with
:class:`UpstreamUnreachable` (the worker never saw the request), :class:`UpstreamTimeout` and
:class:`UpstreamEnded` (the proxy ended it).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

__all__ = [
    "UpstreamEnded",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamUnreachable",
]


class UpstreamError(Exception):
    """The worker could not be reached, broke the connection, or sent something that is not HTTP."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be made (refused, no route): the request never reached the worker."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The request's deadline passed before its answer ended."""


class UpstreamEnded(UpstreamError):
    """The proxy ended the request itself (it is shutting down): no fault of the worker's."""


_Key = tuple[str, str, int]  # scheme, host, port


def _endpoint(url: str) -> tuple[_Key, bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) worker URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, parts.hostname, port), parts.netloc.encode("ascii")


class UpstreamResponse:
    """One answer from a worker, read as it arrives."""

    __slots__ = (
        "_backed_up",
        "_buffered",
        "_chunks",
        "_closed",
        "_conn",
        "_eof",
        "_error",
        "_opened",
        "_sink",
        "_timer",
        "_until_output",
        "_waiter",
        "content_type",
        "keep_alive",
        "status",
    )

    def __init__(self, conn: _Connection, until_output: bool = False) -> None:
        self.status = 0
        self.content_type = ""
        self.keep_alive = False
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._opened: asyncio.Future[None] = conn.loop.create_future()  # what post() waits for
        self._until_output = until_output
        self._timer: asyncio.TimerHandle | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self._backed_up = False
        self._closed = False

    # -- reading --------------------------------------------------------------------------------
    async def _wait(self) -> None:
        """Until the connection feeds, ends or fails this answer."""
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """What arrived since the last read (at least one byte), or ``b""`` at the end."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                self._conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            await self._wait()

    def pipe(self, sink: Callable[[bytes], bool]) -> None:
        """From now on hand the body to ``sink`` as it arrives, in the connection's own callback,
        instead of keeping it for :meth:`readany` (what was kept goes first). ``sink`` must not
        raise; it returns False when its consumer is backed up, and the connection then stops
        reading until :meth:`resume_pipe`. Wait for the end with :meth:`piped`."""
        self._sink = sink
        if self._chunks:
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            if not sink(data):
                self._back_up()

    async def piped(self) -> bool:
        """Wait while the body flows into the sink: True at its end, False when the sink is backed
        up (call :meth:`resume_pipe` once it drained); raises what broke the answer."""
        while True:
            if self._error is not None:
                raise self._error
            if self._eof:
                return True
            if self._backed_up:
                return False
            await self._wait()

    def resume_pipe(self) -> None:
        self._backed_up = False
        self._conn.resume()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    # -- ending -----------------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Fail the reader (now or at its next read) with ``exc`` and drop the connection."""
        if self._closed:
            return
        self._fail(exc)
        self.close()

    def close(self) -> None:
        """The relay is done with this answer: a finished one frees its connection for the next
        request, an unfinished one closes it (the worker then aborts the request)."""
        if self._closed:
            return
        self._closed = True
        self._sink = None  # it holds the relay's state, which holds this answer: no cycle left for the GC
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.finished(self, reusable=self._eof and self._error is None and self.keep_alive)

    # -- fed by the connection ----------------------------------------------------------------------
    def _time_out(self, timeout_s: float) -> None:
        self._timer = None
        self.abort(UpstreamTimeout(f"no complete answer within {timeout_s:g} s"))

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _open(self) -> None:
        if not self._opened.done():
            self._opened.set_result(None)

    def _on_headers(self) -> None:
        if not self._until_output or self.status != 200:
            self._open()

    def _back_up(self) -> None:
        self._backed_up = True
        self._conn.pause()
        self._wake()

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if not sink(data):
                self._back_up()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._conn.pool.high_water:
            self._conn.pause()
        self._open()
        self._wake()

    def _feed_eof(self, keep_alive: bool) -> None:
        self._eof = True
        self.keep_alive = keep_alive
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._open()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._eof or self._error is not None:
            return
        self._error = exc
        if not self._opened.done():
            self._opened.set_exception(exc)
            self._opened.exception()  # retrieved: a failure before the answer is raised by post()
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; at most one request on it at a time."""

    def __init__(self, pool: UpstreamPool, key: _Key, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.paused = False
        self.idle_since = 0.0
        self.framed = False  # the answer being read has a Content-Length or Transfer-Encoding

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection is not safe to reuse
            self._drop()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(UpstreamError(f"the worker sent a malformed HTTP answer ({exc})"))
            self._drop()

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._forget(self)
        resp = self.response
        if resp is not None and exc is None and not self.framed and resp.status and not resp._error:
            resp._feed_eof(False)  # a body delimited by the end of the connection (HTTP/1.0 style)
        elif resp is not None:
            resp._fail(UpstreamError("the worker closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-type" and self.response is not None:
            self.response.content_type = value.split(b";", 1)[0].strip().decode("latin-1")
        elif lname == b"content-length" or lname == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status = self.parser.get_status_code()
            resp._on_headers()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp._feed_eof(self.parser.should_keep_alive())

    # -- flow control and reuse ---------------------------------------------------------------------
    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def finished(self, resp: UpstreamResponse, *, reusable: bool) -> None:
        if self.response is resp:
            self.response = None
        self.pool._busy.discard(self)
        if reusable and not self.lost:
            self.resume()
            self.pool._release(self)
        else:
            self._drop()

    def _drop(self) -> None:
        self.lost = True
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections to the workers, shared by every request of the proxy."""

    def __init__(
        self,
        *,
        max_idle_per_worker: int = 512,
        idle_timeout_s: float = 30.0,
        high_water: int = 256 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_idle_per_worker = max_idle_per_worker
        self.idle_timeout_s = idle_timeout_s
        self.high_water = high_water
        self._clock = clock
        self._idle: dict[_Key, list[_Connection]] = {}
        self._endpoints: dict[str, tuple[_Key, bytes]] = {}
        self._heads: dict[tuple[str, str], bytes] = {}
        self._tls_context: ssl.SSLContext | None = None
        self._closed = False
        self._busy: set[_Connection] = set()  # each with a request in flight

    @property
    def closed(self) -> bool:
        """New requests are refused (shutting down)."""
        return self._closed

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        *,
        timeout_s: float | None = None,
        until_output: bool = False,
        content_type: bytes = b"application/json",
    ) -> UpstreamResponse:
        """POST ``body`` to ``url + path``; returns once the status line and headers are in or, with
        ``until_output``, once a 200 answer's first body bytes (or its end) are in too: one wake-up
        instead of two for a stream, whose headers a server sends before it has any output.

        Raises :class:`UpstreamTimeout` past ``timeout_s`` (counted from now to the end of the
        body, reads included), :class:`UpstreamUnreachable` when no connection can be made and
        :class:`UpstreamError` when the worker breaks the connection before answering."""
        if self._closed:
            raise UpstreamEnded("the proxy's upstream connections are closed (shutting down)")
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        ep = self._endpoints.get(url)
        if ep is None:
            ep = self._endpoints[url] = _endpoint(url)
        key, host = ep
        head = self._heads.get((url, path))
        if head is None:
            head = self._heads[(url, path)] = (
                b"POST "
                + path.encode("ascii")
                + b" HTTP/1.1\r\nHost: "
                + host
                + b"\r\nAccept-Encoding: identity\r\nContent-Type: "
                + content_type
                + b"\r\nContent-Length: "
            )
        request = b"%b%d\r\n\r\n%b" % (head, len(body), body)
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key, loop, deadline, timeout_s)
            if self.closed:  # ended while it connected
                conn._drop()
                raise UpstreamEnded("the proxy's upstream connections are closed (shutting down)")
        resp = UpstreamResponse(conn, until_output)
        conn.response = resp
        self._busy.add(conn)
        if timeout_s is not None and deadline is not None:
            resp._timer = loop.call_at(deadline, resp._time_out, timeout_s)
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            await resp._opened
        except BaseException:
            resp.close()
            raise
        return resp

    async def refuses(self, url: str, timeout_s: float = 2.0) -> bool:
        """Whether ``url``'s worker refuses a new connection now (nothing listens there: its process
        died). A request whose connection broke asks, to tell a dead worker from one that broke one
        request. A process being killed may still hold its listening socket for a moment: the kernel
        completes the handshake, then drops the connection unanswered as the socket closes. So a
        connection that opens is asked ``GET /``; dropped unanswered, one more connect decides (a
        live server, or a forwarder in front of one, opens it again). Any answer, or none within
        ``timeout_s``, says no."""
        key, host = self._endpoints.get(url) or _endpoint(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for _ in range(2):
            try:
                conn = await self._connect(key, loop, deadline, timeout_s)
            except UpstreamUnreachable:
                return True
            except UpstreamTimeout:
                return False
            resp = conn.response = UpstreamResponse(conn)
            assert conn.transport is not None
            conn.transport.write(b"GET / HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
            try:
                async with asyncio.timeout_at(deadline):
                    await resp._opened
                return False  # it answered: it lives
            except TimeoutError:
                return False
            except UpstreamError:
                pass  # dropped unanswered: the next connect tells a closed socket from a live one
            finally:
                conn._drop()
        return False

    async def _connect(
        self, key: _Key, loop: asyncio.AbstractEventLoop, deadline: float | None, timeout_s: float | None
    ) -> _Connection:
        try:
            async with asyncio.timeout_at(deadline):
                if key[0] == "https":
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self, key, loop), key[1], key[2], ssl=self._tls(), server_hostname=key[1]
                    )
                else:
                    _, conn = await loop.create_connection(lambda: _Connection(self, key, loop), key[1], key[2])
        except TimeoutError:
            raise UpstreamTimeout(f"could not connect within {timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect: {exc.strerror or exc}") from None
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context()
        return self._tls_context

    def _take(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = self._clock()
        while idle:
            conn = idle.pop()
            if conn.lost or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.idle_timeout_s:
                conn._drop()
                continue
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= self.max_idle_per_worker:
            conn._drop()
            return
        conn.idle_since = self._clock()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close the idle connections and refuse new requests (answers in flight go on)."""
        self._closed = True
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn._drop()
        self._idle.clear()

    def end_in_flight(self, reason: str) -> int:
        """Close, and end every answer still in flight: its reader gets :class:`UpstreamEnded` with
        ``reason`` and its connection is closed (the worker aborts the request). Returns how many."""
        self.close()
        ended = [conn.response for conn in self._busy if conn.response is not None]
        for resp in ended:
            resp.abort(UpstreamEnded(reason))
        self._busy.clear()
        return len(ended)
