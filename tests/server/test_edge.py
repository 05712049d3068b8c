"""Errors in one shape at the edge: a worker's refusal, aiohttp's own refusals before a handler,
slow request heads (slowloris) and a key over its limits, through a real proxy on a real port."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import openai
import orjson
import pytest

from tests.harness.fake_engine import MODEL
from tests.harness.wait import wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


def _openai_shaped(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


async def test_a_workers_refusal_comes_back_in_openais_shape_with_its_status_and_message(make_proxy):
    h = await make_proxy()
    h.workers[0].fail_next("400")
    with pytest.raises(openai.BadRequestError) as e:
        await h.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert e.value.status_code == 400
    err = _openai_shaped(e.value.body if "error" in e.value.body else {"error": e.value.body})
    assert err["message"] == "n=9 is too large (injected)" and err["type"] == "invalid_request_error"
    h.workers[0].fail_next("400")
    payload = {"model": MODEL, "prompt": "x", "stream": True}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/completions", json=payload) as r:
        assert r.status == 400 and r.content_type == "application/json"  # the raw bytes: no "object": "error"
        assert set(orjson.loads(await r.read())) == {"error"}


async def test_a_header_over_8k_gets_a_json_400_and_one_log_line(make_proxy, caplog):
    h = await make_proxy()
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession() as s, s.get(h.url + "/v1/models", headers={"X-Big": "a" * 9000}) as r:
        assert r.status == 400 and r.content_type == "application/json"
        err = _openai_shaped(await r.json())
    assert err["code"] == "bad_http_request" and err["type"] == "invalid_request_error"
    edge = [rec for rec in caplog.records if rec.name in ("proxy.server.protocol", "aiohttp.server")]
    assert len(edge) == 1 and "before it reached a handler" in edge[0].getMessage()
    assert edge[0].exc_info is None  # one line, no traceback
    async with aiohttp.ClientSession() as s, s.get(h.url + "/health") as r:
        assert r.status == 200  # the proxy serves on


@pytest.mark.looptime
async def test_a_request_head_sent_one_byte_at_a_time_is_cut_off(make_proxy):
    h = await make_proxy(policy={"proxy": {"header_timeout_s": 0.5}})
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    loop = asyncio.get_running_loop()
    start = loop.time()
    answer = asyncio.ensure_future(reader.read(4096))  # whatever the proxy sends, as soon as it does
    for byte in head:
        if answer.done() or loop.time() - start > 5:
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except OSError:  # the proxy closed it
            break
        await asyncio.sleep(0.05)  # one byte each 50 ms (virtual time)
    data = await asyncio.wait_for(answer, timeout=5)
    closed_at = loop.time() - start
    writer.close()
    assert 0.5 <= closed_at < 0.6, "cut off at the head deadline, not before nor long after"
    status, _, rest = data.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408")
    assert _openai_shaped(orjson.loads(rest.partition(b"\r\n\r\n")[2]))["code"] == "request_timeout"
    # a prompt client on another connection is not affected, nor one that takes its time between requests
    async with aiohttp.ClientSession() as s:
        async with s.get(h.url + "/health") as r:
            assert r.status == 200
        await asyncio.sleep(0.7)  # idle past the head deadline (virtual time)
        async with s.get(h.url + "/health") as r:
            assert r.status == 200


@pytest.mark.looptime
async def test_a_slow_body_after_a_prompt_head_is_not_cut_off(make_proxy):
    """The deadline is for the head only: a body may take its time (the request timeout governs it)."""
    h = await make_proxy(policy={"proxy": {"header_timeout_s": 0.3}})
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    for i in range(0, len(body), len(body) // 4 + 1):
        writer.write(body[i : i + len(body) // 4 + 1])
        await writer.drain()
        await asyncio.sleep(0.2)  # 0.8 s in all, past the head deadline (virtual time)
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout=5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200")


@pytest.mark.looptime
async def test_a_body_that_stops_arriving_is_cut_off_with_408(make_proxy):
    """Complete headers, then part of the body and nothing more: 408 once ``body_timeout_s`` passed,
    and the connection not kept (the rest of that body could still come; aiohttp lingers a bounded
    while for it, then closes)."""
    h = await make_proxy(policy={"proxy": {"body_timeout_s": 0.5}})
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model"'
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(4096), timeout=5)
    writer.close()
    assert 0.5 <= loop.time() - start < 0.6, "cut off at the body deadline"
    status, _, rest = data.partition(b"\r\n")
    head, _, body = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    err = _openai_shaped(orjson.loads(body))
    assert err["code"] == "request_timeout" and "proxy.body_timeout_s" in err["message"]


async def test_a_workers_error_event_in_a_stream_comes_back_in_openais_shape(make_proxy):
    h = await make_proxy()
    h.workers[0].fail_next("error_event")
    payload = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 5}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/chat/completions", json=payload) as r:
        raw = await r.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    errors = [orjson.loads(e) for e in events if e.startswith(b'{"error"')]
    assert len(events) == 3 and len(errors) == 1  # two chunks of output, then the error
    assert set(errors[0]) == {"error"}
    err = _openai_shaped(errors[0])
    assert err["message"] == "out of memory (injected)" and err["type"] == "server_error"
    h.workers[0].fail_next("error_event")
    stream = await h.client().chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=5)
    with pytest.raises(openai.APIError, match="out of memory"):
        async for _ in stream:
            pass


async def test_every_inference_answer_carries_its_request_id_the_name_of_its_attempts(make_proxy):
    h = await make_proxy()
    client = h.client()
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    request_id = raw.headers["x-request-id"]
    assert request_id and raw.parse().choices  # what openai's client reads as the answer's request id
    assert h.workers[0].seen_rids[-1] == f"{request_id}.1"  # the worker's log names it by the same id
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True)
    async for _ in stream:
        pass
    assert stream.response.headers["x-request-id"] not in ("", request_id)
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert e.value.request_id  # a refusal has one too, to quote
    async with aiohttp.ClientSession() as s, s.get(h.url + "/v1/chat/completions") as r:
        assert r.status == 405 and set(r.headers["Allow"].split(",")) == {
            "POST",
            "OPTIONS",
        }  # kept through the reshaping
    await client.close()


async def test_browsers_may_call_from_any_origin_by_default_and_a_list_narrows_it(make_proxy):
    h = await make_proxy()
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        async with s.options(h.url + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
        async with s.post(h.url + "/v1/chat/completions", json=payload, headers={"Origin": "https://app.example"}) as r:
            await r.read()
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert "x-request-id" in r.headers["Access-Control-Expose-Headers"]
        async with s.get(h.url + "/v1/models") as r:  # no Origin: not a browser's cross-origin call
            assert "Access-Control-Allow-Origin" not in r.headers
    narrow = await make_proxy(policy={"proxy": {"cors_allow_origins": ["https://app.example"]}})
    async with aiohttp.ClientSession() as s:
        async with s.options(narrow.url + "/v1/models", headers=preflight) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert r.headers["Vary"] == "Origin"
        async with s.options(narrow.url + "/v1/models", headers={**preflight, "Origin": "https://evil.example"}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        async with s.get(narrow.url + "/v1/models", headers={"Origin": "https://evil.example"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
            assert r.headers["Vary"] == "Origin"  # a cache between must not hand this to an allowed origin
        async with s.get(narrow.url + "/v1/nope", headers={"Origin": "https://app.example"}) as r:
            assert r.status == 404  # an unknown path is still no route, for browsers too


async def test_an_options_that_is_no_preflight_is_a_405_and_an_unknown_path_a_404(make_proxy):
    h = await make_proxy()
    async with aiohttp.ClientSession() as s:
        async with s.options(h.url + "/v1/models") as r:
            assert r.status == 405 and _openai_shaped(await r.json())["message"].startswith("Method Not Allowed")
            assert set(r.headers["Allow"].split(",")) == {"GET", "HEAD"}  # the route's own methods
        async with s.options(h.url + "/v1/nope", headers={"Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 404


async def test_a_request_on_an_open_connection_after_the_stop_began_gets_503_shutting_down(make_proxy):
    """A keep-alive connection open as the proxy stops: the next request on it is refused at once
    with 503 ``shutting_down`` (not held until the header deadline and answered 408)."""
    h = await make_proxy(policy={"proxy": {"header_timeout_s": 30, "shutdown_grace_s": 30}})
    host, port = h.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(
        next(v for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n")) if k.lower() == b"content-length")
    )
    await reader.readexactly(length)
    # a stream in flight keeps the stop in its drain while the idle connection is still open (20 s of
    # it in a grace of 30, far past what the next lines take on a starved CPU; it is closed below)
    client = h.client()
    h.workers[0].token_delay_s = 0.2
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=100, stream=True)
    stopping = asyncio.ensure_future(h.runner.cleanup())
    await wait_until(lambda: h.state.drain.open_requests.stopping, "the stop in its drain", every=0)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), timeout=5)  # the answer, then the close
    status, _, rest = data.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 503")
    assert _openai_shaped(orjson.loads(rest.partition(b"\r\n\r\n")[2]))["code"] == "shutting_down"
    writer.close()
    await stream.close()
    await stopping
    await client.close()
