"""The one way a test waits: until a condition holds.

A test never sleeps a guessed duration and hopes the thing happened; it names what it waits for and
polls it. ``wait_until`` reads its deadline from the running loop, so under ``@pytest.mark.looptime``
a wait costs no real time, and with real processes it is real seconds. ``wait_until_blocking`` is the
same for a plain (not async) test that drives a process or a thread. A wait that runs out fails
naming what it waited for, how long, the last value seen and (when given) what the test can say
about why: a log's tail, a status. A deadline is there to end a test that will not pass, not to
time one that does: the default is far past what a CPU shared with other test processes takes
(pytest-xdist runs several side by side); a test that means to bound real time says so beside it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


@overload
async def wait_until(
    check: Callable[[], Awaitable[T]],
    what: str,
    *,
    timeout: float = ...,
    every: float = ...,
    detail: Callable[[], str] | None = ...,
) -> T: ...


@overload
async def wait_until(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = ...,
    every: float = ...,
    detail: Callable[[], str] | None = ...,
) -> T: ...


async def wait_until(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    timeout: float = 30.0,
    every: float = 0.01,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``check`` (sync or async) every ``every`` seconds until it returns something true; return it.

    Fails with an AssertionError naming ``what`` past ``timeout`` seconds of the loop's clock.
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
            raise AssertionError(_ran_out(what, timeout, value, detail))
        await asyncio.sleep(every)


def wait_until_blocking(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = 30.0,
    every: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> T:
    """``wait_until`` for a test without an event loop: polls on the monotonic clock, blocking."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(_ran_out(what, timeout, value, detail))
        time.sleep(every)


def _ran_out(what: str, timeout: float, value: object, detail: Callable[[], str] | None) -> str:
    message = f"waited {timeout:g} s for {what}; last seen {value!r}"
    return message + ("\n" + detail() if detail is not None else "")
