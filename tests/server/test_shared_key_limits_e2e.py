"""Three proxies on one PostgreSQL store (``[store] url``) hold one key's limit together: a key sending
to all three gets what the limit allows once (within 5 %), not three times; the 429s carry
OpenAI's headers as one proxy's do. Each proxy is a whole app on a port of its own, with its own
connection to the store, as three replicas behind a Service."""

from __future__ import annotations

import time

import openai
import pytest

from tests.harness.fake_engine import MODEL

pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
LIMIT = 60  # requests a minute: a full bucket of 60, then one a second


async def test_three_replicas_hold_one_keys_requests_per_minute(make_proxy, monkeypatch, postgres_url) -> None:
    monkeypatch.setenv("TEST_PACER_KEYS", "sk-alice name=alice")
    policy = {
        "auth": {"api_keys_env": "TEST_PACER_KEYS"},
        "admission": {"keys": {"alice": {"requests_per_minute": LIMIT}}},
        "store": {"url": postgres_url},
    }
    fleet = [await make_proxy(policy=policy) for _ in range(3)]
    clients = [h.client("sk-alice") for h in fleet]
    admitted, refused = 0, []
    start = time.monotonic()
    for n in range(3 * LIMIT):  # what each replica alone would admit, to each of them
        try:
            await clients[n % 3].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
            admitted += 1
        except openai.RateLimitError as exc:
            refused.append(exc.response)
    allowed = LIMIT + LIMIT * (time.monotonic() - start) / 60
    for client in clients:
        await client.close()

    assert admitted <= allowed + 1 and admitted >= 0.95 * LIMIT, (admitted, allowed)
    assert refused and all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[-1].headers["x-ratelimit-limit-requests"] == str(LIMIT)
