"""The proxy's stop, its first step: the drain, bounded by ``proxy.shutdown_grace_s``.

On the first SIGTERM or SIGINT the proxy stops listening (aiohttp) and dispatching: each request
still queued gets 503 ``shutting_down`` at once. The requests in flight (those the edge's handlers
are answering, and those on a worker, batch lines too) get the grace to end. What is left then is
ended by the request path (:meth:`~proxy.request.path.RequestPath.end_in_flight`): a stream ends
with an error event (``shutting_down``) as a worker failing mid-stream ends it, a request with no
output yet gets the 503, so every accepted request still gets exactly one answer; a batch line runs
again at the next start. :meth:`Drain.stop_now` (a second signal) ends the wait at once. Then
aiohttp closes the connections (its own ``shutdown_timeout``, short: only a handler outside the
request path can still be open) and the app's lifecycles stop the workers.

Why not aiohttp's ``shutdown_timeout`` alone: past it aiohttp cancels the handler, so a stream just
stops (no error event, no ``[DONE]``), and only after twice the timeout (it waits once for the
handler, then once more after failing the request's body, which a relaying handler no longer reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from proxy.request.path import RequestPath

__all__ = ["Drain", "OpenRequests"]

_log = logging.getLogger(__name__)
_POLL_S = 0.05  # how often the drain looks whether the requests in flight ended


class OpenRequests:
    """How many requests the edge's handlers are answering now
    (:class:`~proxy.server.protocol.EdgeRequestHandler` counts them), and whether the proxy is
    stopping (a request that comes on an open connection then gets 503 ``shutting_down``)."""

    __slots__ = ("count", "stopping")

    def __init__(self) -> None:
        self.count = 0
        self.stopping = False


class Drain:
    """One per app: the drain :meth:`run` does as the app shuts down, and its second signal."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.open_requests = OpenRequests()
        self._now = asyncio.Event()
        self._over = False

    def stop_now(self) -> bool:
        """End the drain at once (or, not begun, make it end at once); False when it is over."""
        self._now.set()
        return not self._over

    async def run(self, requests: RequestPath) -> None:
        """Stop admitting, wait for the requests in flight (at most the grace, or until
        :meth:`stop_now`), then end those left."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            queued = requests.stop_admitting()
            in_flight = requests.in_flight()
            if in_flight:
                _log.info(
                    "stopping: %d request(s) in flight, waiting at most %g s for them to end "
                    "(proxy.shutdown_grace_s; a second SIGTERM or SIGINT ends them now); %d queued refused (503)",
                    in_flight,
                    self.grace_s,
                    queued,
                )
            else:
                _log.info("stopping: no request in flight; %d queued refused (503)", queued)
            deadline = began + self.grace_s

            def left() -> int:
                return max(requests.in_flight(), self.open_requests.count)

            while left() and not self._now.is_set() and (remaining := deadline - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(_POLL_S, remaining)):
                        await self._now.wait()
            if remaining_requests := left():
                ended = requests.end_in_flight()
                _log.warning(
                    "ending %d request(s) still in flight after %.1f s%s: streams end with an error event "
                    "(shutting_down), the others get 503",
                    max(remaining_requests, ended),
                    loop.time() - began,
                    " (stopped now)" if self._now.is_set() else "",
                )
            elif in_flight:
                _log.info("the requests in flight ended within %.1f s", loop.time() - began)
        finally:
            self._over = True
