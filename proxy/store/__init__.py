"""Durable state shared by the proxy's parts: one SQL interface over two backends, and the leader lease.

``sql`` (:class:`~proxy.store.sql.Database`): the embedded SQLite file (the default: nothing to run
beside the proxy) or a PostgreSQL server that several replicas share (``[store] url``). ``lease``
(:class:`~proxy.store.lease.Lease`): a named lease in the same database, held by one holder at a
time until it stops renewing it.

Layering: below ``proxy.batch`` and ``proxy.control``; it imports nothing else of the proxy.
"""

from proxy.store.lease import Lease, LeaseState
from proxy.store.sql import Database, StoreUnavailable, is_postgres_url, open_database

__all__ = ["Database", "Lease", "LeaseState", "StoreUnavailable", "is_postgres_url", "open_database"]
