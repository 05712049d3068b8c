"""The :class:`~proxy.batch.runner.Executor` the proxy runs batches with: each line goes through the
request path (:func:`proxy.request.relay.complete`) in the ``batch`` class, as one request that is
not streamed, paced and dispatched like any other.

The front door's validators check each line as they check a client's request (they are passed in:
this package does not import the front door), its size too (``proxy.max_body_bytes``). A refusal of
the line itself (invalid, or the worker's own error answer) is its result. The proxy's "not now"
answers are not: a full queue, a line that waited ``queue.timeout_s`` for a worker, the key's rate
limit, no worker serving raise :class:`~proxy.batch.runner.NotNow` with their ``Retry-After`` (else
``queue.retry_after_s``), and the runner tries the line again then. A cancel (``withdraw``)
withdraws a line that has not reached a worker; one on a worker finishes. While the proxy shuts
down, a line waits to be cancelled with the runner, so it runs again on the next start instead of
ending in the error file.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from proxy.batch.runner import LineResult, NotNow, Withdrawn
from proxy.errors import ApiError, error_body
from proxy.request import relay
from proxy.request.admission import Priority
from proxy.request.job import Job
from proxy.request.path import RequestPath

Validate = Callable[[bytes], Job]
"""The front door's check of a request body for one endpoint (raises ApiError)."""

# the proxy's own "not now": a full queue, a line that waited out the queue timeout, the key's rate
# limit, no worker serving (a crash loop, or down until an operator restarts one): tried again later
NOT_NOW = frozenset({"queue_full", "queue_timeout", "rate_limit_exceeded", "no_worker"})
SHUTTING_DOWN = "shutting_down"


def _one_key(owner: str) -> str:
    return "batch"


class RequestPathExecutor:
    """Runs batch lines through ``path`` in the ``batch`` class; ``validators`` by endpoint.

    ``key_of_owner`` names the API key a batch's owner stands for: its lines share admission and
    count against that key's limits like the key's other requests (a line over a limit waits)."""

    def __init__(
        self,
        path: RequestPath,
        validators: Mapping[str, Validate],
        *,
        key_of_owner: Callable[[str], str] = _one_key,
        max_body_bytes: int = 0,
    ) -> None:
        self._path = path
        self._validators = validators
        self._key_of_owner = key_of_owner
        self._max_body_bytes = max_body_bytes  # a line's request, as a client's (0: no limit)

    async def execute(self, endpoint: str, body: dict[str, Any], owner: str, withdraw: asyncio.Event) -> LineResult:
        try:
            raw = orjson.dumps(body)
            limit = self._max_body_bytes
            if limit and len(raw) > limit:
                raise ApiError(413, f"the request is {len(raw)} bytes; the limit is {limit} (proxy.max_body_bytes)",
                               code="body_too_large")  # fmt: skip
            job = self._validators[endpoint](raw)
            response = await self._complete(job, self._key_of_owner(owner), withdraw)
        except ApiError as err:
            if err.code == SHUTTING_DOWN:
                await asyncio.Event().wait()  # cancelled with the runner: the line runs on the next start
            if err.code in NOT_NOW:
                wait = (err.headers or {}).get("Retry-After", "")
                raise NotNow(
                    err.message, max(int(wait) if wait.isdigit() else self._path.settings.retry_after_s, 1)
                ) from None
            return LineResult(
                err.status,
                error_body(err.message, type=err.type, param=err.param, code=err.code),
                self._path.new_rid(),
            )
        answer = response.body if isinstance(response.body, bytes) else b""
        return LineResult(response.status, answer, job.upstream_name or self._path.new_rid())

    async def _complete(self, job: Job, key: str, withdraw: asyncio.Event) -> web.Response:
        """The line's answer; :class:`Withdrawn` when ``withdraw`` is set while it is not on a worker
        (in the proxy's queue: taken out of it); once on a worker it runs to its answer."""
        answer = asyncio.ensure_future(relay.complete(self._path, job, Priority.BATCH, key))
        cancel = asyncio.ensure_future(withdraw.wait())
        try:
            await asyncio.wait((answer, cancel), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done() and not job.on_worker:
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
                raise Withdrawn()
            return await answer
        finally:
            cancel.cancel()
            if not answer.done():  # the runner is stopping
                answer.cancel()
