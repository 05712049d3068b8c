"""Native endpoints over raw HTTP: /generate (plain and streaming), info, loads, metrics, abort, flush."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from proxy.engines.base import EventKind
from proxy.engines.sglang.logs import parse_line
from proxy.engines.sglang.metrics import parse_loads, parse_metrics
from tests.harness.wait import wait_until, wait_until_blocking
from tests.sim.helpers import SimProcess, http, start_sim


@pytest.fixture(scope="module")
def sim():
    s = start_sim(
        "--sim-time-scale", "20", "--enable-metrics", "--decode-log-interval", "4", "--max-total-tokens", "60000"
    )
    yield s
    assert s.stop() == 0


def post(sim: SimProcess, path: str, body: object) -> tuple[int, object]:
    status, raw = http("POST", sim.url + path, json.dumps(body).encode())
    return status, json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()


async def sse(
    session: aiohttp.ClientSession, url: str, body: object, events: list[object] | None = None
) -> list[object]:
    """The stream's events, appended to ``events`` (when given) as they arrive."""
    events = [] if events is None else events
    async with session.post(url, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_plain(sim: SimProcess) -> None:
    status, out = post(
        sim,
        "/generate",
        {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 7},
            "sim_output_len": 5,
            "return_logprob": False,
        },
    )
    assert status == 200
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == 5
    assert len(out["output_ids"]) == 5 and len(out["text"].split()) == 5
    assert meta["prompt_tokens"] > 0 and meta["num_retractions"] == 0 and "e2e_latency" in meta
    assert {"cached_tokens", "weight_version", "reasoning_tokens"} <= set(meta)


def test_generate_input_ids_and_batch(sim: SimProcess) -> None:
    status, out = post(sim, "/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    status, outs = post(sim, "/generate", {"text": ["a b", "c d e"], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and isinstance(outs, list) and len(outs) == 2


async def test_generate_stream_cumulative_text(sim: SimProcess) -> None:
    async with aiohttp.ClientSession() as s:
        events = await sse(
            s, sim.url + "/generate", {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 10}}
        )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 10
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 11))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_native_errors(sim: SimProcess) -> None:
    status, out = post(sim, "/generate", {"sampling_params": {}})
    assert status == 400 and out == {"error": {"message": "Either text or input_ids should be provided."}}
    status, raw = http("POST", sim.url + "/generate", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    status, out = post(sim, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}})
    assert status == 400 and "max_new_tokens" in out["error"]["message"]
    status, out = post(sim, "/generate", {"input_ids": list(range(70000))})
    assert status == 400 and "longer than the model's context length" in out["error"]["message"]


def test_info_endpoints(sim: SimProcess) -> None:
    for path in ("/model_info", "/get_model_info"):
        status, raw = http("GET", sim.url + path)
        info = json.loads(raw)
        assert status == 200 and info["model_path"] == "meta-llama/Llama-3.1-8B-Instruct" and info["is_generation"]
    for path in ("/server_info", "/get_server_info"):
        status, raw = http("GET", sim.url + path)
        info = json.loads(raw)
        assert status == 200 and info["version"] == "0.5.23"
        assert info["max_running_requests"] == 2048 and info["chunked_prefill_size"] == 8192
        assert info["schedule_conservativeness"] == 1.0 and info["mem_fraction_static"] == 0.835
        state = info["internal_states"][0]
        assert state["memory_usage"]["token_capacity"] == 60000
        assert "last_gen_throughput" in state and "effective_max_running_requests_per_dp" in state


def test_loads_json_and_prometheus(sim: SimProcess) -> None:
    status, raw = http("GET", sim.url + "/v1/loads")
    sample = parse_loads(json.loads(raw), now=0.0)
    assert status == 200 and sample.max_total_tokens == 60000 and sample.queue == 0
    status, raw = http("GET", sim.url + "/v1/loads?format=prometheus")
    assert status == 200 and 'sglang_num_running_reqs{dp_rank="0"}' in raw.decode()


async def test_metrics_count_what_was_served(sim: SimProcess) -> None:
    _, before = http("GET", sim.url + "/metrics")
    s0 = parse_metrics(before.decode(), 0.0)
    async with aiohttp.ClientSession() as s:
        bodies = [{"text": f"q{i}", "sampling_params": {"max_new_tokens": 20}} for i in range(8)]
        outs = await asyncio.gather(*(s.post(sim.url + "/generate", json=b) for b in bodies))
        for o in outs:
            assert o.status == 200
            o.release()
    _, after = http("GET", sim.url + "/metrics")
    text = after.decode()
    s1 = parse_metrics(text, 1.0)
    assert s1.requests_total - (s0.requests_total or 0) == 8
    assert s1.generation_tokens_total - (s0.generation_tokens_total or 0) == 160
    assert s1.max_total_tokens == 60000 and s1.new_token_ratio is not None
    for needle in (
        "# TYPE sglang:num_running_reqs gauge",
        "sglang:num_retracted_requests_total{",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        "# TYPE sglang:inter_token_latency_seconds histogram",
        "# TYPE sglang:e2e_request_latency_seconds histogram",
        'is_streaming="false"',
        'engine_type="unified"',
        'tp_rank="0"',
        "sglang:cache_hit_rate{",
        "sglang:gen_throughput{",
        "sglang:num_retracted_reqs{",
    ):
        assert needle in text, needle
    assert "_created" not in text


async def test_abort_request_ends_a_stream(sim: SimProcess) -> None:
    arrived: list[object] = []
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            sse(
                s,
                sim.url + "/generate",
                {"text": "long", "stream": True, "rid": "to-abort", "sampling_params": {"max_new_tokens": 20000}},
                arrived,
            )
        )
        await wait_until(lambda: arrived, "the first tokens of the request to abort")
        async with s.post(sim.url + "/abort_request", json={"rid": "to-abort"}) as resp:
            assert resp.status == 200
        events = await asyncio.wait_for(task, 10)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] < 20000


def test_flush_cache(sim: SimProcess) -> None:
    raw = wait_until_blocking(
        lambda: (answer := http("POST", sim.url + "/flush_cache"))[0] == 200 and answer[1],
        "a 200 from /flush_cache",
        every=0.1,
    )
    assert raw.decode().startswith("Cache flushed.")


def test_log_lines_parse(sim: SimProcess) -> None:
    status, _ = post(sim, "/generate", {"text": "a prefill and some decode steps", "sim_output_len": 12})
    assert status == 200  # the log has batch lines whichever tests ran before
    sim.wait_for_line("Decode batch")
    events = [parse_line(line, 0.0) for line in sim.lines]
    kinds = {e.kind for e in events if e is not None}
    assert {EventKind.STARTUP, EventKind.READY, EventKind.BATCH_STATS} <= kinds
    startup = next(e for e in events if e is not None and e.kind is EventKind.STARTUP)
    assert startup.fields["max_total_tokens"] == 60000
    decode = [e for e in events if e is not None and e.kind is EventKind.BATCH_STATS and e.fields["phase"] == "decode"]
    assert decode and all({"running", "queue", "token_usage", "gen_throughput"} <= set(e.fields) for e in decode)


async def test_retraction_over_http_counted_logged_and_recomputed() -> None:
    sim = start_sim("--max-total-tokens", "12000", "--sim-time-scale", "200", "--enable-metrics")
    try:
        async with aiohttp.ClientSession() as s:
            bodies = [
                {
                    "input_ids": list(range(i * 1000, i * 1000 + 200)),
                    "sim_output_len": 100 if i % 3 == 0 else 1500,
                    "sampling_params": {"max_new_tokens": 1500},
                }
                for i in range(60)
            ]

            async def one(body: dict) -> dict:
                async with s.post(sim.url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    return await resp.json()

            outs = await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), 60)
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [b["sim_output_len"] for b in bodies]
        assert any(o["meta_info"]["num_retractions"] > 0 for o in outs)
        _, page = http("GET", sim.url + "/metrics")
        sample = parse_metrics(page.decode(), 0.0)
        assert sample.retractions_total and sample.retractions_total > 0
        events = [parse_line(line, 0.0) for line in sim.lines]
        retractions = [e for e in events if e is not None and e.kind is EventKind.RETRACTION]
        assert retractions and sum(int(e.fields["retracted"]) for e in retractions) == sample.retractions_total
    finally:
        sim.stop()
