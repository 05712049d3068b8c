"""One thread per store connection: its calls run one after another, in the order they were made.

A connection is used by one thread at a time (:mod:`proxy.store.sql`). A call whose awaiting task
was cancelled still runs to its end; the calls made after it wait for it, so a close never cuts
into a transaction under way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class StoreThread:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        """No more calls; those made already end on the thread."""
        self._pool.shutdown(wait=False)
