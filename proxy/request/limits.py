"""Per-key rate limits: requests per minute, tokens per minute, concurrent requests.

Pure classes over a time the caller passes in (``now``, seconds on any monotonic clock), so they
are tested on virtual time. Requests and tokens per minute are token buckets: a bucket holds up to
the per-minute limit and refills at ``limit / 60`` per second; a request takes one request and its
estimated tokens (:func:`proxy.request.admission.estimate_cost`). A request larger than a whole
tokens bucket is let through when the bucket is full (it then owes the difference), so no request
is refused forever. Concurrency counts the key's requests inside the proxy (waiting or on a
worker) until their answer ends.

:meth:`KeyLimiter.acquire` either admits (a :class:`Lease`, released when the request ends) or
raises :class:`RateLimited`, which carries what the 429 answer says: ``Retry-After`` and OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers. An admitted request of a key with
a requests or tokens limit gets the same ``x-ratelimit-*`` headers on its :class:`Lease` (as OpenAI
sends them on successful answers); a key without those limits gets none and costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["KeyLimiter", "KeyLimits", "Lease", "RateLimited", "TokenBucket", "duration"]


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's limits; 0 means none."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)


class TokenBucket:
    """``per_minute`` units a minute, at most ``per_minute`` at once; starts full."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0: now); more than the capacity waits for a full bucket."""
        self.refill(now)
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return max(0.0, (self.capacity - self.level) / self.rate)


class RateLimited(Exception):
    """A request over one of its key's limits; ``headers`` go on the 429."""

    def __init__(self, message: str, retry_after_s: float, headers: Mapping[str, str]) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = dict(headers)


_NO_HEADERS: Mapping[str, str] = {}


class _Releases(Protocol):
    def _release(self, key: str) -> None: ...


class Lease:
    """A request admitted under its key's concurrency limit; :meth:`release` once it ends.
    ``headers``: the key's ``x-ratelimit-*`` after this request (empty without such limits)."""

    __slots__ = ("_limiter", "headers", "key")

    def __init__(self, limiter: _Releases | None, key: str, headers: Mapping[str, str] = _NO_HEADERS) -> None:
        self._limiter = limiter
        self.key = key
        self.headers = headers

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter._release(self.key)
            self._limiter = None


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``0.5s``."""
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


class KeyLimiter:
    """The limits of every configured key; keys without limits pass untouched."""

    def __init__(self, limits: Mapping[str, KeyLimits], concurrent_retry_after_s: float = 1.0) -> None:
        self._limits = {k: v for k, v in limits.items() if v.any}
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self._running: dict[str, int] = {}
        self._concurrent_retry_after_s = concurrent_retry_after_s

    def running(self, key: str) -> int:
        return self._running.get(key, 0)

    async def start(self) -> None:
        """Nothing to start in memory (:class:`~proxy.request.shared_limits.SharedKeyLimiter` opens its store)."""

    async def close(self) -> None:
        """Nothing to hand back in memory."""

    async def admit(self, key: str, cost: int, now: float) -> Lease:
        """:meth:`acquire` as the request path calls it (a limiter shared by replicas may wait for its store)."""
        return self.acquire(key, cost, now)

    def acquire(self, key: str, cost: int, now: float) -> Lease:
        """Admit one request of ``cost`` tokens for ``key`` or raise :class:`RateLimited`."""
        lim = self._limits.get(key)
        if lim is None:
            return Lease(None, key)
        req = self._bucket(self._requests, key, lim.requests_per_minute, now)
        tok = self._bucket(self._tokens, key, lim.tokens_per_minute, now)
        waits: list[tuple[float, str]] = []
        if req is not None and (w := req.wait_for(1, now)) > 0:
            waits.append((w, f"requests per minute ({lim.requests_per_minute})"))
        if tok is not None and (w := tok.wait_for(cost, now)) > 0:
            waits.append((w, f"tokens per minute ({lim.tokens_per_minute}; this request ~{cost} tokens)"))
        running = self._running.get(key, 0)
        if lim.max_concurrent and running >= lim.max_concurrent:
            waits.append((self._concurrent_retry_after_s, f"concurrent requests ({lim.max_concurrent})"))
        if waits:
            wait, what = max(waits)
            raise RateLimited(
                f"rate limit reached for key '{key}' on {what}; retry in {duration(wait)}",
                wait,
                self._headers(lim, req, tok, now, wait),
            )
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(cost)
        self._running[key] = running + 1
        return Lease(self, key, self._rate_headers(lim, req, tok, now) if req or tok else _NO_HEADERS)

    def _release(self, key: str) -> None:
        left = self._running.get(key, 0) - 1
        if left > 0:
            self._running[key] = left
        else:
            self._running.pop(key, None)

    @staticmethod
    def _bucket(buckets: dict[str, TokenBucket], key: str, per_minute: int, now: float) -> TokenBucket | None:
        if not per_minute:
            return None
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = TokenBucket(per_minute, now)
        return b

    @staticmethod
    def _headers(
        lim: KeyLimits, req: TokenBucket | None, tok: TokenBucket | None, now: float, wait: float
    ) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(wait))), **KeyLimiter._rate_headers(lim, req, tok, now)}

    @staticmethod
    def _rate_headers(lim: KeyLimits, req: TokenBucket | None, tok: TokenBucket | None, now: float) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, bucket, limit in (("requests", req, lim.requests_per_minute), ("tokens", tok, lim.tokens_per_minute)):
            if bucket is None:
                continue
            headers[f"x-ratelimit-limit-{name}"] = str(limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(bucket.level)))
            headers[f"x-ratelimit-reset-{name}"] = duration(bucket.reset_s(now))
        return headers
