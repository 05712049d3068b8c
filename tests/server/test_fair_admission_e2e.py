"""Fair admission through a real proxy: keys share by tokens and weights, a key over its limits
gets 429s with OpenAI's rate-limit headers while others go on, interactive goes before batch but
batch keeps its floor, and ``/metrics`` shows it by key name (never the secret)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from proxy.request.admission import Priority
from tests.batch.conftest import CHAT, jsonl, request_line, wait_final_over_http
from tests.harness.fake_engine import MODEL
from tests.harness.wait import wait_until

KEYS = "sk-alice name=alice, sk-bob name=bob, sk-etl batch name=etl"


def _stats(h) -> dict:
    return {(p, k): (s.waiting, s.dispatched, s.dispatched_tokens) for p, k, s in h.state.admission.stats()}


async def _post(s: aiohttp.ClientSession, url: str, key: str, **body) -> int:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **body}
    async with s.post(url + "/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.read()
        return r.status


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("TEST_PACER_KEYS", KEYS)


async def test_two_backlogged_keys_get_tokens_by_weight_whatever_they_send(make_proxy, keys):
    """alice sends 10x the requests of bob; bob has weight 2: while both wait, bob gets 2/3 of the tokens."""
    h = await make_proxy(
        worker={"max_running": 4},
        policy={
            "auth": {"api_keys_env": "TEST_PACER_KEYS"},
            "pacing": {"queue_band": [1, 4], "headroom": 0},
            "admission": {"keys": {"bob": {"weight": 2.0}}},
        },
    )
    # estimated ~2000 tokens each (max_tokens), two tokens of real work: the queue is what is measured
    body = {"max_tokens": 2000, "sim_output_len": 2}
    samples: list[dict] = []
    done = False

    async def watch() -> None:
        while not done:
            st = _stats(h)
            a, b = st.get((Priority.INTERACTIVE, "alice")), st.get((Priority.INTERACTIVE, "bob"))
            if a and b and a[0] > 0 and b[0] > 0:
                samples.append(st)
            await asyncio.sleep(0.002)  # a sampling cadence while the load runs, not a wait

    watcher = asyncio.ensure_future(watch())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        sends = [_post(s, h.url, "sk-alice", **body) for _ in range(300)]
        sends += [_post(s, h.url, "sk-bob", **body) for _ in range(30)]
        statuses = await asyncio.gather(*sends)
    done = True
    await watcher
    assert statuses.count(200) == 330
    assert len(samples) >= 2, "both keys were never backlogged at once"
    first, last = samples[0], samples[-1]
    alice = last[(Priority.INTERACTIVE, "alice")][2] - first[(Priority.INTERACTIVE, "alice")][2]
    bob = last[(Priority.INTERACTIVE, "bob")][2] - first[(Priority.INTERACTIVE, "bob")][2]
    assert bob > 0 and alice > 0
    assert bob / (alice + bob) == pytest.approx(2 / 3, rel=0.1)


async def test_a_key_over_its_limit_gets_429s_with_headers_and_nobody_else_suffers(make_proxy, keys):
    h = await make_proxy(
        policy={
            "auth": {"api_keys_env": "TEST_PACER_KEYS"},
            "admission": {"keys": {"alice": {"requests_per_minute": 3, "tokens_per_minute": 100000}}},
        }
    )
    alice, bob = h.client("sk-alice"), h.client("sk-bob")
    for left in (2, 1):  # successful answers carry the key's limits too (as OpenAI's do)
        raw = await alice.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(left)
        assert raw.headers["x-ratelimit-limit-tokens"] == "100000" and raw.headers["x-ratelimit-reset-tokens"]
    stream = await alice.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
    )
    assert stream.headers["x-ratelimit-remaining-requests"] == "0"
    assert [c async for c in stream.parse()]
    with pytest.raises(openai.RateLimitError) as e:
        await alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = e.value.response
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert r.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) > 90000
    assert e.value.code == "rate_limit_exceeded" and "alice" in e.value.message and "sk-alice" not in e.value.message
    answers = await asyncio.gather(
        *(
            bob.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y"}], max_tokens=2)
            for _ in range(20)
        )
    )
    assert len(answers) == 20
    plain = await bob.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "y"}], max_tokens=2
    )
    assert not [k for k in plain.headers if k.startswith("x-ratelimit")]  # a key without limits: none
    async with aiohttp.ClientSession() as s, s.get(h.url + "/metrics") as m:
        text = await m.text()
    assert 'pacer_requests_rejected_total{reason="rate_limited"} 1.0' in text
    assert 'pacer_key_dispatched_requests_total{key="bob",priority="interactive"} 21.0' in text
    assert "sk-" not in text


async def test_interactive_goes_before_queued_batch_and_batch_keeps_its_floor(make_proxy, keys):
    h = await make_proxy(
        worker={"max_running": 2, "token_delay_s": 0.002},
        policy={
            "auth": {"api_keys_env": "TEST_PACER_KEYS"},
            "pacing": {"queue_band": [1, 4], "headroom": 0},
            "admission": {"batch_floor_share": 0.2},
        },
    )
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        batch = [asyncio.ensure_future(_post(s, h.url, "sk-etl", max_tokens=4)) for _ in range(150)]
        await wait_until(
            lambda: h.state.admission.depth(Priority.BATCH) >= 100, "h.state.admission.depth(Priority.BATCH) >= 100"
        )
        before = _stats(h)[(Priority.BATCH, "etl")][1]
        interactive = [asyncio.ensure_future(_post(s, h.url, "sk-alice", max_tokens=4)) for _ in range(60)]
        assert set(await asyncio.gather(*interactive)) == {200}
        during = _stats(h)[(Priority.BATCH, "etl")][1] - before
        left = h.state.admission.depth(Priority.BATCH)
        assert set(await asyncio.gather(*batch)) == {200}
    assert left > 0, "batch ran out before interactive finished: nothing measured"
    # 60 interactive dispatched while batch waited: batch got ~20% of those dispatches, not 0 and not half
    assert 60 * 0.2 / 0.8 * 0.6 <= during <= 60 * 0.2 / 0.8 * 1.6 + 4


async def test_batch_api_lines_are_admitted_as_their_keys_batch_work(make_proxy, keys):
    h = await make_proxy(policy={"auth": {"api_keys_env": "TEST_PACER_KEYS"}})
    client = h.client("sk-alice")  # an interactive key: its batch lines are still batch work
    data = jsonl(*(request_line(f"l{i}", model=MODEL, max_tokens=2) for i in range(4)))
    uploaded = await client.files.create(file=("in.jsonl", data), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert (await wait_final_over_http(client, created.id)).status == "completed"
    stats = _stats(h)
    assert stats[(Priority.BATCH, "alice")][1] == 4
    assert (Priority.INTERACTIVE, "alice") not in stats


async def test_a_key_flooding_the_full_queue_does_not_lock_another_key_out(make_proxy, keys):
    h = await make_proxy(
        worker={"max_running": 2, "token_delay_s": 0.01},
        policy={
            "auth": {"api_keys_env": "TEST_PACER_KEYS"},
            "queue": {"capacity": 20},
            "pacing": {"queue_band": [0, 1], "headroom": 0},
        },
    )
    worker = h.workers[0]
    worker.set_slots(0)  # the worker holds what it gets: the queue fills however slowly the flood arrives
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        flood = [asyncio.ensure_future(_post(s, h.url, "sk-alice", max_tokens=8)) for _ in range(80)]
        await wait_until(
            lambda: _stats(h).get((Priority.INTERACTIVE, "alice"), (0,))[0] >= 20,
            "alice holding the whole queue",
            timeout=30,
        )
        first = asyncio.ensure_future(_post(s, h.url, "sk-bob", max_tokens=2))
        await wait_until(lambda: _stats(h).get((Priority.INTERACTIVE, "bob"), (0,))[0] >= 1, "bob in the full queue")
        worker.set_slots(2)
        bob = [await first] + [await _post(s, h.url, "sk-bob", max_tokens=2) for _ in range(4)]  # one at a time
        alice = await asyncio.gather(*flood)
    assert bob == [200] * 5  # each pushed out alice's newest instead of getting the 429 itself
    assert alice.count(429) >= 60 - 5 and alice.count(200) + alice.count(429) == 80  # one answer each
    async with aiohttp.ClientSession() as s, s.get(h.url + "/metrics") as r:
        text = await r.text()
    pushed_out = next(
        line
        for line in text.splitlines()
        if line.startswith('pacer_requests_failed_total{pool="default",reason="pushed_out"}')
    )
    assert float(pushed_out.split()[-1]) >= 1  # at least bob's first made room
