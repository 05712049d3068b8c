"""Per-key limits that hold across replicas: :class:`SharedKeyLimiter`, over the store's budgets.

Each replica spends what it took from the shared budgets (:mod:`proxy.store.budgets`) in chunks: a
request it has units and a slot for is admitted with no store call; one it has not waits for one
call that takes the next chunk (requests of the key that arrive meanwhile wait for the same call),
and is refused (429) when the shared bucket has too little. When a replica's units run low it takes
the next chunk in the background, before a request has to wait for it. A chunk is ``chunk`` of the
per-minute limit (at least one unit); a replica holds at most two chunks, taken only while the
bucket holds two more: near empty, each replica takes what its request needs, so what the replicas
hold back stays small against the limit. Concurrency slots are taken one request at a time
(below a limit of 100; past it with a spare of ``chunk``), and a replica keeps the most its requests
needed over the last ``linger_s``: the others go back. Units and slots a replica holds unused for
``idle_s`` go back to the store, and so does all it holds when it stops; its slots are held under an
expiry it renews (a replica that dies frees them within ``hold_s``).

The store unreachable: the replica limits by itself (:class:`~proxy.request.limits.KeyLimiter`'s
in-memory buckets, the whole limit) and tries the store again after ``retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from proxy.request.limits import KeyLimiter, KeyLimits, Lease, RateLimited, TokenBucket, duration
from proxy.store import is_postgres_url, open_database
from proxy.store.budgets import BucketAsk, Budgets, SlotAsk
from proxy.store.thread import StoreThread

__all__ = ["SharedKeyLimiter", "key_limiter"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Held:
    """What this replica holds of one key's budgets."""

    requests: float = 0.0
    tokens: float = 0.0
    slots: int = 0
    running: int = 0
    peak: int = 0  # the most running since the slots were last looked at
    shared: dict[str, float] = field(default_factory=dict)  # the buckets' levels last seen, for the headers
    used: float = 0.0  # wall time of the last request
    empty_until: float = 0.0  # a bucket was too low for a request: until it has refilled, no store call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    topping: asyncio.Task[None] | None = None
    returning: asyncio.Task[None] | None = None


class SharedKeyLimiter(KeyLimiter):
    """:class:`KeyLimiter`'s limits over the fleet; ``open_budgets`` opens this replica's
    :class:`~proxy.store.budgets.Budgets` (called on the limiter's own thread)."""

    def __init__(
        self,
        limits: Mapping[str, KeyLimits],
        open_budgets: Callable[[], Budgets],
        *,
        concurrent_retry_after_s: float = 1.0,
        chunk: float = 0.01,
        idle_s: float = 2.0,
        linger_s: float = 1.0,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(limits, concurrent_retry_after_s)
        self._open_budgets = open_budgets
        self._chunk, self._idle_s, self._linger_s = chunk, idle_s, linger_s
        self._retry_s, self._clock = retry_s, clock
        self._held: dict[str, _Held] = {}
        self._thread: StoreThread | None = None
        self._budgets: Budgets | None = None
        self._upkeep: asyncio.Task[None] | None = None
        self._down_until = 0.0

    async def start(self) -> None:
        """Open the store now (not on the first request); unreachable, the replica limits by itself."""
        self._thread = StoreThread("key-limits")
        self._upkeep = asyncio.create_task(self._keep(), name="shared key limits")
        try:
            await self._store()
        except Exception as exc:
            self._store_down(exc)

    async def close(self) -> None:
        """Hand back every unit and slot held (the requests still running end without them)."""
        tasks = [self._upkeep, *(h.returning for h in self._held.values()), *(h.topping for h in self._held.values())]
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(Exception):
            for key in list(self._held):
                await self._give_back(key, spare=0)
        if self._budgets is not None:
            budgets = self._budgets
            await self._call(budgets.close)
        if self._thread is not None:
            self._thread.shutdown()

    async def _call(self, fn: Callable[[], T]) -> T:
        assert self._thread is not None, "start() the limiter first"
        return await self._thread.call(fn)

    async def _store(self) -> Budgets:
        if self._budgets is None:
            self._budgets = await self._call(self._open_budgets)
        return self._budgets

    def _chunk_of(self, per_minute: int) -> float:
        return max(1.0, per_minute * self._chunk)

    def _fits(self, lim: KeyLimits, held: _Held, cost: int) -> bool:
        return (
            (not lim.requests_per_minute or held.requests >= 1)
            and (not lim.tokens_per_minute or held.tokens >= cost)
            and (not lim.max_concurrent or held.running < held.slots)
        )

    async def admit(self, key: str, cost: int, now: float) -> Lease:
        """Admit one request of ``cost`` tokens for ``key`` or raise :class:`RateLimited`; it waits for
        the store only when this replica holds too little for it."""
        lim = self._limits.get(key)
        if lim is None:
            return Lease(None, key)
        if self._clock() < self._down_until:
            return self.acquire(key, cost, now)
        held = self._held.get(key) or self._held.setdefault(key, _Held())
        held.used = self._clock()
        if not self._fits(lim, held, cost):
            if held.used < held.empty_until and not self._short_of_slots(lim, held):
                raise self._refusal(key, lim, held, cost)
            async with held.lock:
                if not self._fits(lim, held, cost):
                    try:
                        await self._fetch(key, lim, held, cost)
                    except Exception as exc:
                        self._store_down(exc)
                        return self.acquire(key, cost, now)
                if not self._fits(lim, held, cost):
                    raise self._refusal(key, lim, held, cost)
        return self._take(key, lim, held, cost)

    @staticmethod
    def _short_of_slots(lim: KeyLimits, held: _Held) -> bool:
        return bool(lim.max_concurrent) and held.running >= held.slots

    def _take(self, key: str, lim: KeyLimits, held: _Held, cost: int) -> Lease:
        held.requests -= 1 if lim.requests_per_minute else 0
        held.tokens -= cost if lim.tokens_per_minute else 0
        held.running += 1
        held.peak = max(held.peak, held.running)
        low = (lim.requests_per_minute and held.requests < self._chunk_of(lim.requests_per_minute)) or (
            lim.tokens_per_minute and held.tokens < self._chunk_of(lim.tokens_per_minute)
        )
        if low and held.topping is None:
            held.topping = asyncio.create_task(self._top_up(key, lim, held), name=f"key limits {key}")
        headers = self._shared_headers(lim, held) if lim.requests_per_minute or lim.tokens_per_minute else {}
        return Lease(_SharedRelease(self, key), key, headers)

    def _spare_slots(self, lim: KeyLimits) -> int:
        """Slots a replica keeps past its running requests: ``chunk`` of the limit, none below 100."""
        return int(lim.max_concurrent * self._chunk)

    def _release_shared(self, key: str) -> None:
        """A request ended; the slots held past the key's running requests and its spare go back
        ``linger_s`` later, those the requests meanwhile did not need."""
        held = self._held.get(key)
        if held is None or held.running <= 0:
            return
        held.running -= 1
        lim = self._limits[key]
        if lim.max_concurrent and held.slots > held.running + self._spare_slots(lim) and held.returning is None:
            held.returning = asyncio.create_task(self._slots_back(key, held, lim), name=f"key slots {key}")

    async def _slots_back(self, key: str, held: _Held, lim: KeyLimits) -> None:
        """Hand back the slots no request used for ``linger_s`` (past the spare)."""
        try:
            held.peak = held.running
            await asyncio.sleep(self._linger_s)
            if held.slots > held.peak + self._spare_slots(lim):
                await self._give_back(key, self._spare_slots(lim) + held.peak - held.running, units=False)
        except Exception as exc:
            self._store_down(exc)
        finally:
            held.returning = None

    def _asks(self, lim: KeyLimits, held: _Held, cost: int, top_up: bool) -> list[BucketAsk]:
        asks = []
        for kind, per_minute, have, need in (
            ("requests", lim.requests_per_minute, held.requests, 1.0),
            ("tokens", lim.tokens_per_minute, held.tokens, float(cost)),
        ):
            if not per_minute:
                continue
            chunk = self._chunk_of(per_minute)
            if top_up and have < chunk:
                asks.append(BucketAsk(kind, per_minute, 0.0, 2 * chunk - have, keep=2 * chunk))
            elif not top_up and have < need:
                asks.append(BucketAsk(kind, per_minute, need - have, need - have + chunk, keep=2 * chunk))
        return asks

    async def _fetch(self, key: str, lim: KeyLimits, held: _Held, cost: int) -> None:
        """One store call for what the request lacks, and a chunk more of each."""
        asks = self._asks(lim, held, cost, top_up=False)
        slots = None
        if lim.max_concurrent and held.running >= held.slots:
            want = held.running + 1 + self._spare_slots(lim)
            slots = SlotAsk(lim.max_concurrent, held.running + 1, want)
        await self._apply(key, held, asks, slots)

    async def _apply(self, key: str, held: _Held, asks: list[BucketAsk], slots: SlotAsk | None) -> None:
        budgets = await self._store()
        now = self._clock()
        grants, holding = await self._call(partial(budgets.take, key, asks, slots, now))
        for ask, grant in zip(asks, grants, strict=True):
            if ask.kind == "requests":
                held.requests += grant.granted
            else:
                held.tokens += grant.granted
            held.shared[ask.kind] = grant.level
            held.shared[f"{ask.kind}_ready_at"] = now + grant.wait_s
            held.empty_until = max(held.empty_until, now + grant.wait_s)
        if holding is not None:
            held.slots = holding

    async def _top_up(self, key: str, lim: KeyLimits, held: _Held) -> None:
        try:
            async with held.lock:
                asks = self._asks(lim, held, 0, top_up=True)
                if asks:
                    await self._apply(key, held, asks, None)
        except Exception as exc:
            self._store_down(exc)
        finally:
            held.topping = None

    def _store_down(self, exc: Exception) -> None:
        _log.warning(
            "the store's key limits are unreachable, limiting in this replica for %.0f s: %s", self._retry_s, exc
        )
        self._down_until = self._clock() + self._retry_s

    def _refusal(self, key: str, lim: KeyLimits, held: _Held, cost: int) -> RateLimited:
        waits: list[tuple[float, str]] = []
        if lim.requests_per_minute and held.requests < 1:
            waits.append((self._ready_in(held, "requests"), f"requests per minute ({lim.requests_per_minute})"))
        if lim.tokens_per_minute and held.tokens < cost:
            what = f"tokens per minute ({lim.tokens_per_minute}; this request ~{cost} tokens)"
            waits.append((self._ready_in(held, "tokens"), what))
        if lim.max_concurrent and held.running >= held.slots:
            waits.append((self._concurrent_retry_after_s, f"concurrent requests ({lim.max_concurrent})"))
        wait, what = max(waits)
        headers = {"Retry-After": str(max(1, math.ceil(wait))), **self._shared_headers(lim, held)}
        return RateLimited(f"rate limit reached for key '{key}' on {what}; retry in {duration(wait)}", wait, headers)

    def _ready_in(self, held: _Held, kind: str) -> float:
        return max(0.0, held.shared.get(f"{kind}_ready_at", 0.0) - self._clock())

    def _shared_headers(self, lim: KeyLimits, held: _Held) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers from what this replica holds and the fleet's levels last seen."""
        now = time.monotonic()
        buckets: dict[str, Any] = {}
        for kind, per_minute, have in (
            ("requests", lim.requests_per_minute, held.requests),
            ("tokens", lim.tokens_per_minute, held.tokens),
        ):
            if per_minute:
                bucket = buckets[kind] = TokenBucket(per_minute, now)
                bucket.level = min(bucket.capacity, have + held.shared.get(kind, bucket.capacity))
        return self._rate_headers(lim, buckets.get("requests"), buckets.get("tokens"), now)

    async def _keep(self) -> None:
        """Renew this replica's slots; hand back what a key left unused for ``idle_s``."""
        while True:
            await asyncio.sleep(min(self._idle_s, 5.0))
            try:
                if self._budgets is not None:
                    budgets, now = self._budgets, self._clock()
                    await self._call(partial(budgets.renew, now))
                for key, held in list(self._held.items()):
                    if self._clock() - held.used >= self._idle_s and (held.requests or held.tokens or held.slots):
                        await self._give_back(key, spare=0)
            except Exception as exc:
                self._store_down(exc)

    async def _give_back(self, key: str, spare: int, *, units: bool = True) -> None:
        """Hand back the key's units and the slots past its running requests and ``spare``; the
        units leave this replica's hold before the call (the requests admitted meanwhile take none)."""
        held, lim, budgets = self._held[key], self._limits[key], self._budgets
        if budgets is None:
            return
        async with held.lock:
            back = [(k, pm, have) for k, pm, have in self._units(lim, held) if units and have > 0]
            keep = held.running + spare
            slots = keep if lim.max_concurrent and held.slots > keep else None
            if not back and slots is None:
                return
            self._add(held, back, -1)
            now = self._clock()
            try:
                await self._call(partial(budgets.give_back, key, back, slots, now))
            except BaseException:
                self._add(held, back, 1)
                raise
            if slots is not None:
                held.slots = min(held.slots, max(slots, held.running))

    @staticmethod
    def _units(lim: KeyLimits, held: _Held) -> list[tuple[str, int, float]]:
        return [
            (kind, per_minute, have)
            for kind, per_minute, have in (
                ("requests", lim.requests_per_minute, held.requests),
                ("tokens", lim.tokens_per_minute, held.tokens),
            )
            if per_minute
        ]

    @staticmethod
    def _add(held: _Held, units: list[tuple[str, int, float]], sign: int) -> None:
        for kind, _, have in units:
            if kind == "requests":
                held.requests += sign * have
            else:
                held.tokens += sign * have


class _SharedRelease:
    """A shared lease's end: the key's running count in this replica (its slots stay held)."""

    __slots__ = ("_key", "_limiter")

    def __init__(self, limiter: SharedKeyLimiter, key: str) -> None:
        self._limiter, self._key = limiter, key

    def _release(self, key: str) -> None:
        self._limiter._release_shared(key)


def key_limiter(limits: Mapping[str, KeyLimits], store_url: str, *, concurrent_retry_after_s: float) -> KeyLimiter:
    """The request path's limiter: shared by the replicas when ``store_url`` names a PostgreSQL server
    and a key has limits; in this process's memory otherwise (SQLite is one replica's)."""
    if not is_postgres_url(store_url) or not any(lim.any for lim in limits.values()):
        return KeyLimiter(limits, concurrent_retry_after_s)
    holder = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"

    def open_budgets() -> Budgets:
        return Budgets(open_database(store_url, Path(), "unused"), holder)

    return SharedKeyLimiter(limits, open_budgets, concurrent_retry_after_s=concurrent_retry_after_s)
