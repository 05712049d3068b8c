"""The one way a test waits: until a condition holds, on the event loop's clock.

A test never sleeps a guessed duration and hopes the thing happened; it names what it waits for and
polls it. The deadline is read from the running loop, so under ``@pytest.mark.looptime`` a wait costs
no real time, and with real processes it is real seconds. A wait that runs out fails naming what it
waited for, how long, and (when given) what the test can say about why.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    timeout: float = 10.0,
    every: float = 0.01,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``check`` (sync or async) every ``every`` seconds until it returns something true; return it.

    Fails with an AssertionError naming ``what`` past ``timeout`` seconds of the loop's clock, with the
    last value seen and ``detail()`` (a log's tail, a status) when given.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= end:
            message = f"waited {timeout:g} s for {what}; last seen {value!r}"
            raise AssertionError(message + ("\n" + detail() if detail is not None else ""))
        await asyncio.sleep(every)
