"""The store's thread: a call whose caller was cancelled still ends before the next one starts (a
close never cuts into a transaction under way)."""

from __future__ import annotations

import asyncio
import threading

from proxy.store.thread import StoreThread
from tests.harness.wait import wait_until


async def test_a_cancelled_call_ends_before_the_next_one_starts() -> None:
    thread = StoreThread("test-store")
    release, order = threading.Event(), []

    def transaction() -> None:
        order.append("begin")
        release.wait(timeout=30)
        order.append("commit")

    look = asyncio.ensure_future(thread.call(transaction))
    await wait_until(lambda: order == ["begin"], "the transaction under way")
    look.cancel()  # as stop() cancels a look under way
    close = asyncio.ensure_future(thread.call(order.append, "close"))
    await asyncio.sleep(0)
    assert order == ["begin"] and not close.done()  # the close waits for the commit
    release.set()
    await close
    assert order == ["begin", "commit", "close"]
    thread.shutdown()
