"""The relay's upstream client against scripted HTTP servers on real sockets.

Each test's server is a plain asyncio server whose replies are written by hand, so that framing,
timing and connection handling (keep-alive, close, reset, silence) are exactly what the test says.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from proxy.request.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from tests.harness.wait import wait_until

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Script:
    """A server that answers every request on every connection with ``reply``; counts connections
    and requests and records each request's head and body."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_peer = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_peer.set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                await self.reply(reader, writer)
                if writer.is_closing():
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    async def __aenter__(self) -> Script:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def sized(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b" % (
        len(body),
        extra,
        body,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def test_sized_answers_reuse_one_connection_and_send_the_body() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(sized(b'{"ok": true}'))

    pool = UpstreamPool()
    async with Script(reply) as srv:
        for i in range(3):
            resp = await pool.post(srv.url, "/v1/completions", b'{"n": %d}' % i, timeout_s=5)
            assert (resp.status, resp.content_type) == (200, "application/json")
            assert await resp.read() == b'{"ok": true}'
            resp.close()
        assert srv.connections == 1 and pool.idle_connections() == 1
        head, body = srv.requests[2]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body == b'{"n": 2}'
        assert b"Content-Length: 8\r\n" in head and b"Host: 127.0.0.1:" in head
    pool.close()


@pytest.mark.looptime
async def test_stream_arrives_chunk_by_chunk_and_until_output_waits_for_the_first() -> None:
    go = asyncio.Event()
    first_read = asyncio.Event()

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        await w.drain()
        await go.wait()  # headers alone: post(until_output=True) must not return yet
        w.write(chunk(b"data: 1\n\n"))
        await w.drain()
        await first_read.wait()  # the second chunk only once the client has the first: two reads
        w.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    pool = UpstreamPool()
    async with Script(reply) as srv:
        opening = asyncio.ensure_future(pool.post(srv.url, "/generate", b"{}", timeout_s=5, until_output=True))
        await asyncio.sleep(0.1)  # a while with the headers alone (virtual time)
        assert not opening.done()
        go.set()
        resp = await opening
        assert resp.content_type == "text/event-stream"
        assert await resp.readany() == b"data: 1\n\n"
        first_read.set()
        assert await resp.readany() == b"data: 2\n\n"
        assert await resp.readany() == b""
        resp.close()
        assert pool.idle_connections() == 1
    pool.close()


async def test_connection_close_and_unfinished_answers_are_not_reused() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if len(srv.requests) == 1:
            w.write(sized(b"a", b"Connection: close\r\n"))
            await w.drain()
            w.close()
        else:
            w.write(SSE_HEAD + chunk(b"data: x\n\n"))  # and never ends

    pool = UpstreamPool()
    async with Script(reply) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5)
        assert await resp.read() == b"a"
        resp.close()
        assert pool.idle_connections() == 0
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5, until_output=True)
        assert await resp.readany() == b"data: x\n\n"
        resp.close()  # the relay gave up on an unfinished stream: the worker must see the disconnect
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
        assert pool.idle_connections() == 0 and srv.connections == 2
    pool.close()


async def test_a_worker_that_closed_an_idle_connection_costs_nothing() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(sized(b"ok"))
        await w.drain()
        w.close()  # keep-alive promised, but the server closes the idle connection right after

    pool = UpstreamPool()
    async with Script(reply) as srv:
        for _ in range(2):
            resp = await pool.post(srv.url, "/x", b"", timeout_s=5)
            assert await resp.read() == b"ok"
            resp.close()
            await wait_until(
                lambda: pool.idle_connections() == 0, "pool.idle_connections() == 0"
            )  # the FIN arrives while idle: it leaves the pool
        assert srv.connections == 2
    pool.close()


@pytest.mark.looptime
async def test_deadline_covers_the_whole_answer() -> None:
    """On virtual time: the deadline fires exactly ``timeout_s`` after the POST, reads included."""

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if len(srv.requests) == 1:
            w.write(sized(b"ok"))  # the first answers: its connection stays in the pool
        else:
            await asyncio.sleep(30)  # silent (virtual time)

    async def slow_stream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await asyncio.sleep(30)  # a stream that stops (virtual time)

    loop = asyncio.get_running_loop()
    pool = UpstreamPool()
    async with Script(silent) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5)
        assert await resp.read() == b"ok"
        resp.close()
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout, match=r"no complete answer within 0\.3 s"):
            await pool.post(srv.url, "/x", b"", timeout_s=0.3)
        assert loop.time() - t0 == pytest.approx(0.3)
    async with Script(slow_stream) as srv:
        t0 = loop.time()
        resp = await pool.post(srv.url, "/x", b"", timeout_s=0.3, until_output=True)
        assert await resp.readany() == b"data: 1\n\n"
        with pytest.raises(UpstreamTimeout):
            await resp.readany()
        assert loop.time() - t0 == pytest.approx(0.3)
        resp.close()
    pool.close()


async def test_a_stream_broken_midway_raises_and_a_refused_connect_is_an_error() -> None:
    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await w.drain()
        w.transport.abort()

    pool = UpstreamPool()
    async with Script(reply) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5, until_output=True)
        assert await resp.readany() == b"data: 1\n\n"
        with pytest.raises(UpstreamError, match="closed the connection"):
            await resp.readany()
        resp.close()
        url = srv.url
        assert not await pool.refuses(url)  # it broke one answer, and listens still
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.post(url, "/x", b"", timeout_s=5)  # the server is gone
    assert await pool.refuses(url)
    pool.close()


async def test_a_listener_that_drops_connections_unanswered_and_then_closes_is_a_dead_worker() -> None:
    """A process being killed holds its listening socket a moment after its open connections broke:
    the kernel completes a new handshake, then resets it unanswered as the socket closes. That is a
    refusal; a server that drops connections unanswered but listens on is not."""
    pool = UpstreamPool()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # nobody accepts: the kernel alone completes each handshake, as for a dying process
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    asking = asyncio.ensure_future(pool.refuses(url))
    await wait_until(lambda: _pending_connections(listener) > 0, "the handshake completed by the kernel")
    assert not asking.done()  # asked on the connection, it waits for an answer
    listener.close()  # the process's last file closes: the pending connection is reset
    assert await asking
    pool.close()

    async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.transport.abort()

    pool = UpstreamPool()
    async with Script(drop) as srv:
        assert not await pool.refuses(srv.url)  # it drops each connection, and opens the next one
        assert srv.connections == 2  # asked twice: not a silence that ran out
    pool.close()


def _pending_connections(listener: socket.socket) -> int:
    """Connections the kernel completed on ``listener`` that nobody accepted yet (Linux: the
    accept queue's length, as ``ss`` reads it), read here without accepting them."""
    port = listener.getsockname()[1]
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(
        1
        for row in rows
        if int(row[1].split(":")[1], 16) == port and row[3] == "0A" and int(row[4].split(":")[1], 16) > 0
    )


async def test_body_delimited_by_close_and_malformed_answers() -> None:
    async def http10(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await w.drain()
        w.close()

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    pool = UpstreamPool()
    async with Script(http10) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5)
        assert await resp.read() == b"all of it"
        resp.close()
    async with Script(garbage) as srv:
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.post(srv.url, "/x", b"", timeout_s=5)
    pool.close()


async def test_abort_wakes_the_reader_and_drops_the_connection() -> None:
    class TakenBack(Exception):
        pass

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)  # headers, then nothing: a queued request on a busy server

    pool = UpstreamPool()
    async with Script(reply) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5)
        reading = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0)  # the reader runs until it waits for data (none comes)
        assert not reading.done()
        resp.abort(TakenBack())
        with pytest.raises(TakenBack):
            await reading
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
        assert pool.idle_connections() == 0
    pool.close()


async def test_a_slow_reader_pauses_the_socket_until_it_catches_up() -> None:
    piece = b"x" * 65536

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        for _ in range(64):  # 4 MiB, far past the pool's high-water mark and the socket buffers
            w.write(chunk(piece))
            await w.drain()
        w.write(b"0\r\n\r\n")

    pool = UpstreamPool(high_water=128 * 1024)
    async with Script(reply) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=10, until_output=True)
        await wait_until(
            lambda: resp._conn.paused, "resp._conn.paused"
        )  # nobody reads: the connection must stop at the mark
        # the mark plus at most one socket read (up to 256 KiB) past it, not the 4 MiB sent
        assert resp._conn.paused and 128 * 1024 < resp._buffered <= 128 * 1024 + 256 * 1024 + 16
        total = 0
        while data := await resp.readany():
            total += len(data)
        assert total == 64 * 65536
        resp.close()
        assert pool.idle_connections() == 1
    pool.close()


async def test_pipe_hands_the_body_to_a_sink_and_stops_while_it_is_backed_up() -> None:
    release = asyncio.Event()

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD + chunk(b"a"))
        await w.drain()
        await release.wait()
        w.write(chunk(b"b") + chunk(b"c") + b"0\r\n\r\n")

    got: list[bytes] = []
    backed_up = [True]

    def sink(data: bytes) -> bool:
        got.append(data)
        return not backed_up[0]

    pool = UpstreamPool()
    async with Script(reply) as srv:
        resp = await pool.post(srv.url, "/x", b"", timeout_s=5, until_output=True)
        resp.pipe(sink)  # "a" was kept for readany: it goes to the sink first, which says it is full
        assert got == [b"a"] and await resp.piped() is False and resp._conn.paused
        backed_up[0] = False
        resp.resume_pipe()
        release.set()
        assert await resp.piped() is True
        assert b"".join(got) == b"abc"
        resp.close()
        assert pool.idle_connections() == 1
    pool.close()
