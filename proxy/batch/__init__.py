"""A durable OpenAI Batch API: ``/v1/files`` and ``/v1/batches`` over SQLite or PostgreSQL, via the proxy.

Modules, bottom up: ``jsonl`` (OpenAI's limits, the check of each line), ``shapes`` (the wire
objects), ``store`` (the database, :mod:`proxy.store`: SQLite or a shared PostgreSQL, and the files on disk;
exactly-once results), ``runner`` (runs the
lines of unfinished batches), ``service`` (the operations per owner, the lifecycle), ``routes``
(the aiohttp handlers), ``executor`` (each line through the proxy's request path, batch class).

The seam the composition root provides: an :class:`Executor` whose ``execute(endpoint, body,
owner, withdraw)`` sends one line through admission and returns its final answer, or raises
``NotNow`` (tried again after its ``Retry-After``) or ``Withdrawn``; the data directory; the
runner's ``concurrency``; ``accepts_model``; and ``authenticate(request)`` for the routes.
``proxy.compose`` owns the service in a ``cleanup_ctx`` (``BatchService.open``).

Durability: :mod:`proxy.batch.store`. Cancel and expiry: :mod:`proxy.batch.runner`.

Layering: ``proxy.batch`` sits beside ``proxy.server``. It may import ``proxy.request`` and below,
never ``proxy.server``, ``proxy.compose`` nor ``proxy.cli`` (the ``layers`` contract); the front
door's request validators reach :class:`~proxy.batch.executor.RequestPathExecutor` as an argument.
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
