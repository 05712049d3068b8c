"""The relay through a real proxy over real sockets, with the openai client, in front of fake workers."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from proxy.workers.base import WorkerState
from tests.harness.fake_engine import MODEL
from tests.harness.wait import wait_until

pytestmark = pytest.mark.looptime  # the fake workers' token pace, the scrapes and the deadlines on virtual time


async def _turns(n: int) -> None:
    """Let the event loop run ``n`` times round."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_chat_and_completions_plain_and_streamed(make_proxy):
    h = await make_proxy(n_workers=2)
    client = h.client()
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == "tok tok tok "
    comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert comp.choices[0].text == "tok tok "
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream]
    assert "".join(pieces) == "t0 t1 t2 t3 t4 "
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "t0 t1 t2 "
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # every upstream request carried a proxy rid, each one distinct
    rids = [r for w in h.workers for r in w.seen_rids]
    assert len(rids) == 4 and len(set(rids)) == 4 and all(r.startswith("pacer-") for r in rids)
    await client.close()


async def test_stream_is_relayed_as_it_arrives(make_proxy):
    h = await make_proxy(worker={"token_delay_s": 0.2})
    client = h.client()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True)
    arrivals = [loop.time() - t0 async for _ in stream]
    # 5 chunks, 0.2 s apart at the worker: the first must arrive long before the last
    assert len(arrivals) == 5
    assert arrivals[-1] - arrivals[0] > 0.5
    await client.close()


async def _leave_mid_stream(h) -> None:
    """A client that opens a long stream, reads its first output and goes away."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            h.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
        )
        assert resp.status == 200
        await resp.content.readany()
        resp.close()


async def test_client_disconnect_frees_slot_and_aborts_upstream(make_proxy):
    h = await make_proxy(worker={"token_delay_s": 0.05})
    w = h.workers[0]
    await _leave_mid_stream(h)
    await wait_until(lambda: h.state.board.get("w0").in_flight == 0, "h.state.board.get('w0').in_flight == 0")
    await wait_until(lambda: len(w.aborted) == 1, "len(w.aborted) == 1")
    assert w.aborted == [w.seen_rids[0]]
    await wait_until(lambda: w.running == 0, "w.running == 0")
    assert w.finished == []


async def test_a_worker_that_aborts_only_by_closing_gets_no_name_and_no_abort_call(make_proxy):
    # vLLM has no /abort_request and no rid: a request is sent as the client sent it, and a client
    # that leaves mid-stream ends it by the connection closing alone
    h = await make_proxy(policy={"engine": {"speaks": "vllm"}}, worker={"token_delay_s": 0.05, "speaks": "vllm"})
    w = h.workers[0]
    await _leave_mid_stream(h)
    await wait_until(lambda: h.state.board.get("w0").in_flight == 0, "h.state.board.get('w0').in_flight == 0")
    await wait_until(lambda: w.running == 0, "w.running == 0")  # the closed connection ended it
    await h.state.requests.wait_background()
    assert w.seen_rids == [None] and "rid" not in w.bodies[0]
    assert w.not_found == [] and w.aborted == [] and w.finished == []


async def test_disconnect_while_queued_in_proxy_withdraws_request(make_proxy):
    h = await make_proxy(worker={"token_delay_s": 0.05, "max_running": 1})
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(
            s.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 20})
        )
        await wait_until(lambda: h.state.board.get("w0").in_flight == 1, "h.state.board.get('w0').in_flight == 1")
        h.pool.set_state("w0", WorkerState.DRAINING)  # nothing more goes to the worker: the next one waits in the proxy
        second = asyncio.ensure_future(
            s.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": "b", "max_tokens": 1})
        )
        await wait_until(lambda: len(h.state.admission) == 1, "len(h.state.admission) == 1")
        second.cancel()
        await wait_until(lambda: len(h.state.admission) == 0, "len(h.state.admission) == 0")
        h.pool.set_state("w0", WorkerState.READY)  # the dispatcher hands out work here, synchronously
        assert h.state.board.get("w0").in_flight == 1  # the first alone: the withdrawn one got no worker
        resp = await first
        assert resp.status == 200
    await wait_until(lambda: h.state.board.get("w0").in_flight == 0, "h.state.board.get('w0').in_flight == 0")
    assert len(h.workers[0].seen_rids) == 1  # the withdrawn request never reached the worker
    # every admitted request ends in one outcome: the one that left while it waited counts as a disconnect
    assert h.state.metrics.of("default").disconnected._value.get() == 1
    dispatched = {k: st.dispatched for _, k, st in h.state.admission.stats()}
    assert sum(dispatched.values()) == 1  # the withdrawn one was never sent


async def test_retry_on_other_worker_when_one_fails_before_output(make_proxy):
    h = await make_proxy(n_workers=2)
    client = h.client()
    for mode in ("500", "reset"):
        for w in h.workers:
            w.seen_rids.clear()
        h.workers[0].fail_next(mode, 10)
        h.workers[1].fail_next(mode, 0)
        # both idle with equal load: the tie goes to w0, which fails; the retry must avoid it
        comp = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert comp.choices[0].text == "tok tok "
        assert len(h.workers[0].seen_rids) == 1 and len(h.workers[1].seen_rids) == 1
        assert h.workers[0].seen_rids[0] != h.workers[1].seen_rids[0]  # a fresh rid per attempt
        h.workers[0].fail_none()
    await client.close()


async def test_failures_exhaust_attempts_then_clear_error(make_proxy):
    h = await make_proxy(n_workers=1, policy={"pacing": {"max_attempts": 2}})
    h.workers[0].fail_next("500", 5)
    client = h.client()
    with pytest.raises(openai.InternalServerError) as exc:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert exc.value.status_code == 502
    assert "HTTP 500" in exc.value.message and "2 attempt" in exc.value.message
    assert len(h.workers[0].seen_rids) == 2
    await client.close()


async def test_a_plain_stream_whose_worker_breaks_goes_on_from_its_text(make_proxy):
    h = await make_proxy(n_workers=2)
    h.workers[0].fail_next("midstream")
    h.workers[1].fail_next("500", 0)
    client = h.client()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True)
    chunks = [c async for c in stream]
    # two tokens from w0, then its connection died: w1 goes on from "x t0 t1 " for the 8 left
    assert [c.choices[0].text for c in chunks if c.choices[0].text] == ["t0 ", "t1 "] + [f"t{i} " for i in range(8)]
    assert chunks[-1].choices[0].finish_reason == "length" and {c.id for c in chunks} == {chunks[0].id}
    assert len(h.workers[0].bodies) == 1 and len(h.workers[1].bodies) == 1
    going_on = h.workers[1].bodies[0]
    assert going_on["prompt"] == "x" + "t0 t1 " and going_on["max_tokens"] == 8
    assert going_on["rid"] == h.workers[0].bodies[0]["rid"][:-2] + ".2.g"  # the request's second attempt
    await client.close()


async def test_a_stream_that_cannot_go_on_ends_with_an_error_event_when_its_worker_breaks(make_proxy):
    h = await make_proxy()
    h.workers[0].fail_next("midstream")
    client = h.client()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True, stop=["zz"])
    got = []
    with pytest.raises(openai.APIError) as exc:
        async for c in stream:
            got.append(c.choices[0].text)
    assert got == ["t0 ", "t1 "]
    assert "mid-stream" in str(exc.value)
    assert len(h.workers[0].seen_rids) == 1  # a stop string could span the seam: not continued
    await client.close()


async def test_take_back_requeues_unstarted_request_once(make_proxy):
    # w0 has one slot: a streamed request runs there (output started), a second waits in w0's own
    # queue. The controller drains w0 and takes back what produced no output: only the waiting
    # one, which then runs on w1. Each request is answered once.
    h = await make_proxy(
        n_workers=2, policy={"pacing": {"queue_band": [2, 4]}}, worker={"max_running": 1, "token_delay_s": 0.02}
    )
    d = h.state.requests.dispatcher_of("default")
    h.pool.set_state("w1", WorkerState.DRAINING)
    client = h.client()

    got: list[str] = []

    async def streamed() -> str:
        s = await client.completions.create(model=MODEL, prompt="a", max_tokens=30, stream=True)
        async for c in s:
            got.append(c.choices[0].text)
        return "".join(got)

    long = asyncio.ensure_future(streamed())
    await wait_until(lambda: len(got) >= 1, "len(got) >= 1")
    queued = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="b", max_tokens=2))
    await wait_until(lambda: len(h.workers[0].waiting) == 1, "len(h.workers[0].waiting) == 1")
    h.pool.set_state("w0", WorkerState.DRAINING)
    h.pool.set_state("w1", WorkerState.READY)
    assert d.take_back("w0") == 1
    text, b = await asyncio.gather(long, queued)
    assert text == "".join(f"t{i} " for i in range(30)) and b.choices[0].text == "tok tok "
    assert len(h.workers[0].finished) == 1 and len(h.workers[1].finished) == 1
    assert len(h.workers[0].aborted) == 1  # the taken-back one was aborted at w0
    assert await d.wait_idle("w0", 2.0)
    assert h.state.metrics.registry.get_sample_value("pacer_requests_requeued_total", {"pool": "default"}) == 1
    await client.close()


@pytest.mark.looptime(False)  # counts loop turns and the kernel's socket buffers: real time
async def test_a_slow_client_holds_back_the_worker_and_gets_every_byte(make_proxy):
    # 5,000 chunks of ~4 KB (20 MB) as fast as the worker can write them, to a client that stops
    # reading: the proxy must stop reading from the worker (back-pressure) instead of buffering the
    # stream, then deliver all of it, intact and in order, once the client reads again.
    n = 5000
    h = await make_proxy(worker={"token_delay_s": 0.0, "pad": 4000})
    worker = h.workers[0]
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        body = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": {n}, "stream": true}}'.encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        received = [await reader.read(4096)]  # the stream started
        # the client reads nothing: buffers fill up and the worker must stall. The worker writes one
        # chunk per loop turn while it can, and the proxy, the worker and this client share one loop:
        # while the proxy read on, the worker would emit within any 200 turns
        async with asyncio.timeout(30):
            while True:
                stalled_at = worker.emitted
                await _turns(200)
                if worker.emitted == stalled_at:
                    break
        await _turns(1000)
        # held back: the kernel may still take a little more as its socket buffers grow (under CPU
        # contention their ACKs come late), but the stream stays far from written out
        assert stalled_at <= worker.emitted < n // 2, "the worker kept writing while the client read nothing"
        async with asyncio.timeout(30):
            while not received[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                received.append(await reader.read(2**20))
    finally:
        writer.close()
    assert worker.emitted == n
    head, rest = b"".join(received).split(b"\r\n\r\n", 1)
    assert b"Transfer-Encoding: chunked" in head
    body, at = bytearray(), 0
    while True:  # undo the HTTP chunked framing
        eol = rest.index(b"\r\n", at)
        size = int(rest[at:eol], 16)
        if size == 0:
            break
        body += rest[eol + 2 : eol + 2 + size]
        at = eol + 2 + size + 2
    texts = [line for line in bytes(body).split(b"\n") if line.startswith(b"data: {")]
    assert len(texts) == n
    assert all(b'"text":"t%d ' % i in t for i, t in enumerate(texts))


async def test_a_worker_too_slow_is_a_504_upstream_timeout_not_retried(make_proxy):
    h = await make_proxy(policy={"proxy": {"request_timeout_s": 0.2}}, worker={"token_delay_s": 1.0})
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/completions", json=payload) as r:
        body = await r.json()
    assert r.status == 504
    assert body["error"]["code"] == "upstream_timeout" and "within 0.2 s" in body["error"]["message"]
    assert len(h.workers[0].seen_rids) == 1


async def test_facts_per_request_and_the_usage_event_only_for_clients_that_asked(make_proxy):
    h = await make_proxy()
    client = h.client()
    facts = h.state.board.get(h.pool.workers()[0].id).facts
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    # the proxy asked the worker for the usage event; this client did not, so it never sees it
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "t0 t1 t2 t3 "
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_headers={"x-pacer-priority": "batch"})
    recent = facts.recent()
    assert [f.interactive for f in recent] == [True, True, False]  # the class each was sent as
    assert facts.mean_output_tokens(interactive=False) == 2 and facts.mean_ttft(interactive=False) is None
    assert [(f.output_tokens, f.max_tokens, f.prompt_tokens) for f in recent] == [(4, 4, 3), (8, 8, 3), (2, 2, 3)]
    assert [f.finish_reason for f in recent] == ["length"] * 3
    assert recent[0].ttft_s is not None and recent[0].ttft_s >= 0 and recent[2].ttft_s is None
    assert all(f.queue_s >= 0 for f in recent)
    assert facts.output_ratio() == 1.0 and facts.mean_output_tokens() == pytest.approx(14 / 3)
    await client.close()


async def test_events_split_across_reads_are_rewritten_whole(make_proxy):
    # a worker on another host may deliver an event in two reads: the usage event the proxy asked
    # for must still be kept from a client that did not ask, and an error event still reshaped
    h = await make_proxy(worker={"split_events": True})
    client = h.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks and all(c.choices and c.usage is None for c in chunks)  # no `choices: []` chunk to trip on
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "t0 t1 t2 t3 "
    assert h.state.board.get(h.pool.workers()[0].id).facts.recent()[-1].output_tokens == 4  # the facts read it
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    h.workers[0].fail_next("error_event")
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/chat/completions", json=payload) as r:
        raw = await r.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) == 4
    assert orjson.loads(events[2])["error"]["type"] == "server_error"  # OpenAI's shape, not SGLang's
    await client.close()
