"""The :class:`~proxy.batch.runner.Executor` the proxy runs batches with: each line goes through the
request path (:func:`proxy.request.relay.complete`) in the ``batch`` class, as one request that is
not streamed, paced and dispatched like any other.

The front door's validators check each line as they check a client's request (they are passed in:
this package does not import the front door). A refusal of the line itself (invalid, or the
worker's own error answer) is its result. The proxy's "not now" answers are not: a full queue, or a
line that waited ``queue.timeout_s`` for a worker, is submitted again after ``retry_after_s`` (the
line stays in the batch until it is answered; the completion window stops lines from starting, not
running ones). While the proxy shuts down, a line waits to be cancelled with the runner, so it runs
again on the next start instead of ending in the error file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from proxy.batch.runner import LineResult
from proxy.errors import ApiError, error_body
from proxy.request import relay
from proxy.request.admission import Priority
from proxy.request.job import Job
from proxy.request.path import RequestPath

Validate = Callable[[bytes], Job]
"""The front door's check of a request body for one endpoint (raises ApiError)."""

NOT_NOW = frozenset({"queue_full", "queue_timeout", "rate_limit_exceeded"})
SHUTTING_DOWN = "shutting_down"


def _one_key(owner: str) -> str:
    return "batch"


class RequestPathExecutor:
    """Runs batch lines through ``path`` in the ``batch`` class; ``validators`` by endpoint.

    ``key_of_owner`` names the API key a batch's owner stands for: its lines share admission and
    count against that key's limits like the key's other requests (a line over a limit waits)."""

    def __init__(
        self, path: RequestPath, validators: Mapping[str, Validate], *, key_of_owner: Callable[[str], str] = _one_key
    ) -> None:
        self._path = path
        self._validators = validators
        self._key_of_owner = key_of_owner

    async def execute(self, endpoint: str, body: dict[str, Any], owner: str) -> LineResult:
        try:
            job = self._validators[endpoint](orjson.dumps(body))
            key = self._key_of_owner(owner)
            while True:
                try:
                    response = await relay.complete(self._path, job, Priority.BATCH, key)
                    break
                except ApiError as err:
                    if err.code == SHUTTING_DOWN:
                        await asyncio.Event().wait()  # cancelled with the runner: the line runs on the next start
                    if err.code not in NOT_NOW:
                        raise
                    wait = (err.headers or {}).get("Retry-After", "")
                await asyncio.sleep(max(int(wait) if wait.isdigit() else self._path.settings.retry_after_s, 1))
        except ApiError as err:
            return LineResult(
                err.status,
                error_body(err.message, type=err.type, param=err.param, code=err.code),
                self._path.new_rid(),
            )
        answer = response.body if isinstance(response.body, bytes) else b""
        return LineResult(response.status, answer, job.upstream_name or self._path.new_rid())
