"""The Batch API as the proxy serves it (``build_app`` on a free port): the ``openai`` client uploads
and runs a batch whose lines go through the request path, in front of a real simulated worker
process and, where the test holds the worker, in front of an in-process fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.request.admission import Priority
from proxy.server.state import PROXY
from proxy.workers.base import WorkerState
from tests.batch.conftest import CHAT, content_lines, jsonl, request_line, wait_final_over_http
from tests.harness.fake_engine import MODEL as FAKE_MODEL
from tests.harness.fake_engine import FakeEngine
from tests.harness.sim_proxy import serve_sims
from tests.harness.static_pool import StaticPool
from tests.harness.wait import wait_until

SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name


def _refused_full(h: Any) -> float:
    """``pacer_requests_rejected_total{reason="queue_full"}`` from the proxy's /metrics text."""
    prefix = 'pacer_requests_rejected_total{reason="queue_full"} '
    lines = h.state.metrics.render().decode().splitlines()
    return sum(float(line.removeprefix(prefix)) for line in lines if line.startswith(prefix))


def _client(url: str, api_key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture
async def sim_proxy(tmp_path: Path) -> AsyncIterator[str]:
    """The proxy in front of one ``pacer sim`` worker process; its batches under ``tmp_path``."""
    pacing = {"queue_band": [4, 16], "headroom": 4, "scrape_interval_s": 0.05, "stale_after_s": 1.0}
    async with serve_sims(tmp_path, {"workers": 1, "args": {"max_running_requests": 16}}, pacing=pacing) as p:
        pool, st = p.pool, p.state
        await wait_until(
            lambda: [w.state for w in pool.workers()] == [WorkerState.READY],
            "[w.state for w in pool.workers()] == [WorkerState.READY]",
            timeout=60,
        )
        await wait_until(
            lambda: all(st.board.get(w.id).sample is not None for w in pool.workers()),
            "all(st.board.get(w.id).sample is not None for w in pool.workers())",
            timeout=20,
        )
        yield p.url
    assert all(w.state is WorkerState.STOPPED for w in pool.workers())


async def test_a_batch_of_five_lines_through_the_proxy_to_a_simulated_worker(sim_proxy: str) -> None:
    client = _client(sim_proxy)
    ids = [f"req-{n}" for n in range(5)]
    lines = [request_line(i, model=SIM_MODEL, max_tokens=4, sim_output_len=4) for i in ids]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    batch = await wait_final_over_http(client, created.id)

    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts is not None and batch.request_counts.completed == 5
    assert batch.output_file_id is not None
    output = await content_lines(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == ids
    for line in output:
        answer = line["response"]
        assert answer["status_code"] == 200 and answer["request_id"]
        assert answer["body"]["object"] == "chat.completion" and answer["body"]["usage"]["completion_tokens"] == 4
        assert answer["body"]["choices"][0]["message"]["content"]
    with pytest.raises(openai.NotFoundError):
        await _client(sim_proxy, "key-b").batches.retrieve(created.id)
    await client.close()


async def test_a_line_the_engine_refuses_is_in_the_error_file_in_openais_shape(sim_proxy: str) -> None:
    """SGLang refuses max_tokens beyond the context with {"object": "error", ...}; the error file
    holds OpenAI's {"error": {...}} with the engine's status and message."""
    client = _client(sim_proxy)
    lines = [request_line("ok", model=SIM_MODEL, max_tokens=2, sim_output_len=2),
             request_line("too-long", model=SIM_MODEL, max_tokens=10_000_000)]  # fmt: skip
    uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    batch = await wait_final_over_http(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is not None
    [refused] = await content_lines(client, batch.error_file_id)
    assert refused["custom_id"] == "too-long" and refused["response"]["status_code"] == 400
    body = refused["response"]["body"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "maximum context length" in body["error"]["message"]
    await client.close()


async def test_batch_lines_wait_in_the_batch_class_and_an_unserved_model_is_refused(
    make_proxy: Callable[..., Any],
) -> None:
    h = await make_proxy()
    client = h.client("key-a")
    await client.models.list()  # the proxy learns the served models
    h.pool.set_state("w0", WorkerState.DRAINING)  # nothing dispatches: the lines stay in the proxy queue
    ids = [f"q{n}" for n in range(3)]
    lines = [request_line(i, model=FAKE_MODEL, max_tokens=2) for i in ids]
    unserved = await client.files.create(
        file=("in.jsonl", jsonl(*lines, request_line("x", model="nope"))), purpose="batch"
    )
    refused = await wait_final_over_http(
        client, (await client.batches.create(input_file_id=unserved.id, endpoint=CHAT, completion_window="24h")).id
    )
    assert refused.status == "failed" and refused.errors is not None and refused.errors.data is not None
    assert [(e.code, e.line) for e in refused.errors.data] == [("model_not_found", 4)]
    assert "'nope'" in (refused.errors.data[0].message or "")
    assert h.state.admission.depth(Priority.BATCH) == 0  # none of its lines was sent

    uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")

    await wait_until(
        lambda: h.state.admission.depth(Priority.BATCH) == 3, "h.state.admission.depth(Priority.BATCH) == 3", timeout=20
    )
    assert h.state.admission.depth(Priority.INTERACTIVE) == 0
    h.pool.set_state("w0", WorkerState.READY)
    batch = await wait_final_over_http(client, created.id)

    assert batch.status == "completed" and batch.output_file_id is not None and batch.error_file_id is None
    assert sorted(line["custom_id"] for line in await content_lines(client, batch.output_file_id)) == ids
    assert sorted(body["messages"][0]["content"] for body in h.workers[0].bodies) == ids
    await client.close()


async def test_a_line_the_full_queue_refuses_is_submitted_again_not_failed(make_proxy: Callable[..., Any]) -> None:
    h = await make_proxy(policy={"queue": {"capacity": 1, "retry_after_s": 0}, "batch": {"concurrency": 3}})
    client = h.client("key-a")
    h.pool.set_state("w0", WorkerState.DRAINING)
    ids = ["a", "b", "c"]
    uploaded = await client.files.create(
        file=("in.jsonl", jsonl(*(request_line(i, model=FAKE_MODEL, max_tokens=2) for i in ids))), purpose="batch"
    )
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    await wait_until(
        lambda: h.state.admission.depth(Priority.BATCH) == 1 and _refused_full(h) >= 2,
        "h.state.admission.depth(Priority.BATCH) == 1 and _refused_full(h) >= 2",
        timeout=20,
    )

    h.pool.set_state("w0", WorkerState.READY)
    batch = await wait_final_over_http(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is None and batch.output_file_id is not None
    assert sorted(line["custom_id"] for line in await content_lines(client, batch.output_file_id)) == ids
    await client.close()


async def test_lines_queued_when_the_proxy_stops_run_on_its_next_start(tmp_path: Path) -> None:
    engine = FakeEngine()
    worker_url = await engine.start()
    policy = parse_policy(
        {
            "engine": {"kind": "external", "urls": [worker_url]},
            "pacing": {"queue_band": [2, 8], "headroom": 0, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
            "batch": {"dir": str(tmp_path / "batches")},
        },
        "<batch restart>",
    )
    ids = ["a", "b", "c"]
    try:
        pool = StaticPool([worker_url])
        app = build_app(policy, pool)
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            await wait_until(
                lambda: app[PROXY].board.get("w0").sample is not None,
                "app[PROXY].board.get('w0').sample is not None",
                timeout=20,
            )
            pool.set_state("w0", WorkerState.DRAINING)
            async with _client(f"http://127.0.0.1:{port}") as client:
                data = jsonl(*(request_line(i, model=FAKE_MODEL, max_tokens=2) for i in ids))
                uploaded = await client.files.create(file=("in.jsonl", data), purpose="batch")
                created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
            await wait_until(
                lambda: app[PROXY].admission.depth(Priority.BATCH) == 3,
                "app[PROXY].admission.depth(Priority.BATCH) == 3",
                timeout=20,
            )
        finally:
            async with asyncio.timeout(30):  # a stop does not wait for the queued lines
                await runner.cleanup()
        assert engine.bodies == []

        app = build_app(policy, StaticPool([worker_url]))
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with _client(f"http://127.0.0.1:{port}") as client:
                batch = await wait_final_over_http(client, created.id)
                assert batch.status == "completed" and batch.output_file_id is not None, batch
                output = await content_lines(client, batch.output_file_id)
        finally:
            await runner.cleanup()
    finally:
        await engine.stop()
    assert [line["custom_id"] for line in output] == ids
    assert sorted(body["messages"][0]["content"] for body in engine.bodies) == ids


async def test_a_rate_limited_owner_s_batch_leaves_the_slots_to_others_and_cancels_at_once(
    make_proxy: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """alice's key allows 2 requests a minute: her batch's lines are told "not now" (429, Retry-After
    some 30 s). They give their runner slots back while they wait, so etl's batch beside it runs as
    if alone; and a cancel ends alice's batch at once (her waiting lines reached no worker)."""
    monkeypatch.setenv("TEST_BATCH_KEYS", "sk-alice name=alice, sk-etl batch name=etl")
    h = await make_proxy(
        policy={
            "auth": {"api_keys_env": "TEST_BATCH_KEYS"},
            "admission": {"keys": {"alice": {"requests_per_minute": 2}}},
            "batch": {"concurrency": 4},
        }
    )
    alice, etl = h.client("sk-alice"), h.client("sk-etl")
    mine = [request_line(f"a{n}", model=FAKE_MODEL, max_tokens=2) for n in range(20)]
    uploaded = await alice.files.create(file=("a.jsonl", jsonl(*mine)), purpose="batch")
    held = await alice.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    await wait_until(lambda: (h.state.metrics.registry.get_sample_value(
        "pacer_requests_rejected_total", {"reason": "rate_limited"}) or 0) >= 2, "(h.state.metrics.registry.get_sample_value(         'pacer_requests_rejected_total', {'reason': 'rate_limited'}) or 0) >= 2", timeout=20)  # fmt: skip

    theirs = [request_line(f"e{n}", model=FAKE_MODEL, max_tokens=2) for n in range(10)]
    uploaded = await etl.files.create(file=("e.jsonl", jsonl(*theirs)), purpose="batch")
    created = await etl.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    async with asyncio.timeout(10):  # alice's Retry-After is some 30 s: not behind her lines
        done = await wait_final_over_http(etl, created.id)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 10

    await alice.batches.cancel(held.id)
    async with asyncio.timeout(10):
        cancelled = await wait_final_over_http(alice, held.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts is not None
    assert cancelled.request_counts.completed == 2 and cancelled.request_counts.total == 20  # her minute's two
    await alice.close()
    await etl.close()


async def test_a_cancel_withdraws_the_lines_waiting_in_the_proxy_queue(make_proxy: Callable[..., Any]) -> None:
    h = await make_proxy()
    client = h.client("key-a")
    h.pool.set_state("w0", WorkerState.DRAINING)  # nothing dispatches: the lines wait in the proxy's queue
    lines = [request_line(f"q{n}", model=FAKE_MODEL, max_tokens=2) for n in range(5)]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    await wait_until(
        lambda: h.state.admission.depth(Priority.BATCH) == 5, "h.state.admission.depth(Priority.BATCH) == 5", timeout=20
    )
    await client.batches.cancel(created.id)
    async with asyncio.timeout(10):
        batch = await wait_final_over_http(client, created.id)
    assert batch.status == "cancelled" and batch.error_file_id is not None
    assert h.state.admission.depth(Priority.BATCH) == 0
    errors = await content_lines(client, batch.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == [f"q{n}" for n in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    h.pool.set_state("w0", WorkerState.READY)
    assert h.workers[0].bodies == []  # none reached the worker
    await client.close()


async def test_a_line_over_the_body_limit_is_refused_as_a_client_s_request_would_be(
    make_proxy: Callable[..., Any],
) -> None:
    h = await make_proxy(policy={"proxy": {"max_body_bytes": 4096}})
    client = h.client("key-a")
    lines = [request_line("small", model=FAKE_MODEL, max_tokens=2), request_line("x" * 5000, model=FAKE_MODEL)]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    batch = await wait_final_over_http(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is not None and batch.output_file_id is not None
    [refused] = await content_lines(client, batch.error_file_id)
    assert refused["response"]["status_code"] == 413
    assert "the limit is 4096 (proxy.max_body_bytes)" in refused["response"]["body"]["error"]["message"]
    assert len(h.workers[0].bodies) == 1
    await client.close()
