"""Per-key limits on virtual time: token buckets for requests and tokens a minute, concurrency."""

from __future__ import annotations

import pytest

from proxy.request.limits import KeyLimiter, KeyLimits, RateLimited, TokenBucket


def test_bucket_refills_at_its_rate_up_to_its_capacity():
    b = TokenBucket(60, now=0.0)  # one a second
    b.take(60)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    assert b.wait_for(1, 1.0) == 0.0
    assert b.reset_s(1.0) == pytest.approx(59.0)
    b.refill(1000.0)
    assert b.level == 60


def test_requests_per_minute_with_headers():
    lim = KeyLimiter({"a": KeyLimits(requests_per_minute=2)})
    lim.acquire("a", 10, 0.0).release()
    lim.acquire("a", 10, 0.0).release()
    with pytest.raises(RateLimited) as e:
        lim.acquire("a", 10, 0.0)
    h = e.value.headers
    assert h["Retry-After"] == "30"  # 2 a minute: one comes back every 30 s
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "1m0s"
    assert "x-ratelimit-limit-tokens" not in h
    assert "requests per minute" in e.value.message and "'a'" in e.value.message
    lim.acquire("a", 10, 30.0)  # one request refilled


def test_tokens_per_minute_and_a_request_larger_than_the_bucket():
    lim = KeyLimiter({"a": KeyLimits(tokens_per_minute=600)})
    lim.acquire("a", 500, 0.0).release()
    with pytest.raises(RateLimited) as e:
        lim.acquire("a", 200, 0.0)
    assert e.value.retry_after_s == pytest.approx(10.0)
    h = e.value.headers
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("600", "100")
    assert h["x-ratelimit-reset-tokens"] == "50s"
    lim.acquire("a", 200, 10.0)
    lim.acquire("a", 5000, 70.0)  # larger than the bucket: passes once it is full, and owes the rest
    with pytest.raises(RateLimited):
        lim.acquire("a", 1, 71.0)


def test_concurrency_and_other_keys_untouched():
    lim = KeyLimiter({"a": KeyLimits(max_concurrent=1)}, concurrent_retry_after_s=2)
    lease = lim.acquire("a", 1, 0.0)
    with pytest.raises(RateLimited, match="concurrent") as e:
        lim.acquire("a", 1, 0.0)
    assert e.value.headers["Retry-After"] == "2"
    for _ in range(100):
        lim.acquire("b", 10**6, 0.0)  # no limits configured for b
    lease.release()
    lease.release()  # twice is harmless
    assert lim.running("a") == 0
    lim.acquire("a", 1, 0.0)
