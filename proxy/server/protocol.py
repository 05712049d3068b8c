"""The HTTP edge below the handlers: what aiohttp refuses before a handler runs, and slow headers.

aiohttp answers a request it cannot parse (a header over 8 KiB, a malformed request line) itself,
before any middleware runs, with a plain-text 400 and a traceback in the log each time, so an
unauthenticated client could flood the log. :class:`EdgeRequestHandler` answers those in OpenAI's
error shape (``code`` ``bad_http_request``, aiohttp's status and reason kept) and logs one line.

aiohttp has no limit on how long a client may take to send its request head: a connection that
sends a header byte a second is held open for ever (slowloris). The handler arms a timer when the
first byte of a request head arrives; when the head is not complete within ``header_timeout_s``
it answers 408 in the same JSON shape and closes the connection. Idle keep-alive connections are
aiohttp's ``keepalive_timeout``'s business, and a request body is the handler's (``body_timeout_s``).
Once the proxy stops, aiohttp keeps idle connections open but reads nothing more from them: a
request sent on one then gets 503 ``shutting_down`` at once, and the connection is closed.

:class:`EdgeRunner` is ``web.AppRunner`` serving with this handler, which counts the requests it is
answering (:class:`~proxy.server.drain.OpenRequests`: what the shutdown's drain waits for), and
:class:`Listener` its address, bound before the runner is set up (before the app starts anything:
its workers), so an address in use fails first; :class:`ListenerSite` serves it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.errors import error_body, type_for_status
from proxy.server.drain import OpenRequests

__all__ = ["EdgeRequestHandler", "EdgeRunner", "Listener", "ListenerSite"]

_log = logging.getLogger(__name__)


class EdgeRequestHandler(RequestHandler):
    """aiohttp's connection handler with JSON refusals, one log line each, and a header deadline."""

    def __init__(self, *args: Any, header_timeout_s: float, open_requests: OpenRequests, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._open_requests = open_requests
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_request = False  # a head was parsed and its handler has not ended yet

    def data_received(self, data: bytes) -> None:
        if data and self._open_requests.stopping and not self._in_request:
            self._refuse_stopping()  # aiohttp would drop it unread: the client would wait for nothing
            return
        if not self._in_request and self._head_timer is None and data and self._header_timeout_s > 0:
            self._head_timer = self._loop.call_later(self._header_timeout_s, self._head_too_slow)
        before = self._request_count
        super().data_received(data)
        if self._request_count > before:
            self._in_request = True
            self._cancel_head_timer()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        self._in_request = True
        self._open_requests.count += 1
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._open_requests.count -= 1
            self._in_request = bool(self._messages)  # a pipelined request parsed already: its body may follow

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        transport = self.transport
        if self._in_request or transport is None or transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        _log.warning(
            "closed a connection from %s: its request headers did not arrive within %g s (proxy.header_timeout_s)",
            peer[0] if isinstance(peer, tuple) else peer,
            self._header_timeout_s,
        )
        body = error_body(
            f"the request headers did not arrive within {self._header_timeout_s:g} s",
            type="invalid_request_error",
            code="request_timeout",
        )
        transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        self.force_close()
        transport.close()

    def _refuse_stopping(self) -> None:
        """A request on a connection kept open while the proxy stops: 503 ``shutting_down``, closed."""
        self._cancel_head_timer()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = error_body(
            "sglang-pacer is shutting down and did not answer the request; send it again",
            type="service_unavailable",
            code="shutting_down",
        )
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) or (exc is None and status != 500):
            reason = (exc.message if isinstance(exc, HttpProcessingError) else None) or message or "bad request"
            reason = " ".join(str(reason).split())[:300]
            _log.warning("refused a request from %s before it reached a handler: %s", request.remote, reason)
            code, kind = "bad_http_request", type_for_status(status)
        elif status == 504:
            reason, code, kind = "the request handler timed out", "timeout", "server_error"
        else:
            _log.error("unhandled error on a request from %s", request.remote, exc_info=exc)
            reason, code, kind = "internal error in the proxy (see its log)", None, "server_error"
        if request.writer.output_size > 0:
            raise ConnectionError("the response already started; cannot send an error answer")
        resp = web.Response(
            status=status, body=error_body(reason, type=kind, code=code), content_type="application/json"
        )
        resp.force_close()
        return resp


class _EdgeServer(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, open_requests: OpenRequests, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._open_requests = open_requests

    def pre_shutdown(self) -> None:
        self._open_requests.stopping = True  # from now on a request on an open connection gets 503
        super().pre_shutdown()

    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(
            self,
            loop=self._loop,
            header_timeout_s=self._header_timeout_s,
            open_requests=self._open_requests,
            **self._kwargs,
        )


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are served by :class:`EdgeRequestHandler`, counting the
    requests they answer into ``open_requests``."""

    def __init__(
        self, app: web.Application, *, header_timeout_s: float, open_requests: OpenRequests, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._open_requests = open_requests

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app's own server: its handler and request factory
        return _EdgeServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            header_timeout_s=self._header_timeout_s,
            open_requests=self._open_requests,
            **plain._kwargs,  # the handler settings the runner was given (access log, keep-alive, ...)
        )


class Listener:
    """An address bound before the app starts (:meth:`bind`; ``web.TCPSite`` binds only once the app
    has started: its workers), served once :class:`ListenerSite` starts. :meth:`close` releases one
    never served (one served closes with its site)."""

    def __init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self.port = 0  # the bound one (0 asked: a free one)
        self.factory: Callable[[], asyncio.BaseProtocol] | None = None  # its connections' handler, once served

    @classmethod
    async def bind(cls, host: str, port: int, *, backlog: int = 128) -> Listener:
        """Bind and listen on ``host:port`` (its first address; connections wait in the backlog until
        it is served); raises ``OSError`` when the address cannot be bound (in use, not this host's).
        Listening at once holds the port: a socket only bound (``create_server``'s
        ``start_serving=False``) lets another ``SO_REUSEADDR`` server bind it meanwhile, and under
        uvloop that one then gets every connection."""
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            listener = cls()
            listener.port = int(sock.getsockname()[1])
            listener._server = await loop.create_server(
                listener._connection, sock=sock, backlog=backlog, start_serving=False
            )
        except BaseException:
            sock.close()
            raise
        return listener

    @property
    def server(self) -> asyncio.AbstractServer:
        assert self._server is not None, "not bound"
        return self._server

    def _connection(self) -> asyncio.BaseProtocol:
        assert self.factory is not None, "a connection was accepted before the listener was served"
        return self.factory()

    def close(self) -> None:
        self.server.close()


class ListenerSite(web.BaseSite):
    """The runner's site on a :class:`Listener` (made once the runner is set up)."""

    def __init__(self, runner: web.BaseRunner, listener: Listener, host: str) -> None:
        super().__init__(runner)
        self._listener = listener
        self._host = host

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._listener.port}"

    async def start(self) -> None:
        await super().start()
        self._listener.factory = self._runner.server
        self._server = self._listener.server  # the runner's cleanup stops this site: it closes
        await self._server.start_serving()
