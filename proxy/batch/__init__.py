"""A durable OpenAI Batch API: ``/v1/files`` and ``/v1/batches`` over SQLite, run through the proxy.

Modules, bottom up::

    jsonl    OpenAI's limits (50,000 requests, 200 MB) and the check of each request line
    shapes   the wire objects: File, Batch, list pages, output and error lines
    store    SQLite (WAL) + the files on disk; exactly-once results; BatchStore, StoreThread
    runner   BatchRunner: executes the lines of unfinished batches through an Executor
    service  BatchService: the operations per owner, and the lifecycle (BatchService.open)
    routes   the aiohttp handlers (add_routes, BATCH_SERVICE)
    executor RequestPathExecutor: the proxy's Executor (each line through the request path, batch class)

The seam: what the composition root provides.

- An :class:`Executor`: ``async def execute(endpoint, body, owner, withdraw) -> LineResult(status_code,
  body, request_id)`` that sends one request through the proxy's admission (in the ``batch`` class)
  and returns the final answer, or raises ``NotNow`` (the proxy's "not now": tried again after its
  ``Retry-After``) or ``Withdrawn`` (``withdraw`` was set before the line reached a worker). ``owner``
  is the hash of the API key that created the batch.
- The data directory (the policy's, e.g. ``.pacer/batches``), the runner's ``concurrency`` (how many
  lines it keeps in flight; the admission paces them) and ``accepts_model`` (which models a batch may
  name).
- ``authenticate(request) -> api key`` for the routes (raising ``ApiError`` to refuse a caller); the
  default reads the bearer token unchecked.

Wiring: the composition root (``proxy.compose``) registers the routes with the proxy's API-key check
as ``authenticate``, and owns the service in a ``cleanup_ctx`` generator::

    async with BatchService.open(policy.batch.dir, RequestPathExecutor(requests, VALIDATORS),
                                 concurrency=policy.batch.concurrency, accepts_model=...) as service:
        app[BATCH_SERVICE] = service
        yield

Durability: see :mod:`proxy.batch.store`. Cancel and expiry: see :mod:`proxy.batch.runner`.

Layering: ``proxy.batch`` sits beside ``proxy.server`` (independent of it): it may import
``proxy.request`` and the layers below, never ``proxy.server``, ``proxy.compose`` nor ``proxy.cli``
(the ``layers`` contract in ``pyproject.toml``); the front door's request validators reach
:class:`~proxy.batch.executor.RequestPathExecutor` as an argument.
"""

from proxy.batch.routes import BATCH_SERVICE, Authenticate, add_routes, bearer_key
from proxy.batch.runner import BatchRunner, Executor, LineResult, NotNow, Withdrawn
from proxy.batch.service import BatchService, owner_of
from proxy.batch.store import BatchStore, StoreThread

__all__ = [
    "BATCH_SERVICE",
    "Authenticate",
    "BatchRunner",
    "BatchService",
    "BatchStore",
    "Executor",
    "LineResult",
    "NotNow",
    "StoreThread",
    "Withdrawn",
    "add_routes",
    "bearer_key",
    "owner_of",
]
