"""A worker's death fails no request that has not started: the whole proxy (front door, request
path, supervisor, controller in ``auto``) in front of one real ``pacer sim`` process, over real
sockets, the worker SIGKILLed while clients keep it busy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name


async def _until(cond, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"{what}: not reached within {timeout:g} s"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def one_sim_worker(tmp_path: Path, **engine_args: object) -> AsyncIterator[tuple[str, ProxyState]]:
    policy = parse_policy({
        "engine": {"kind": "sim", "workers": 1, "args": {"max_running_requests": 64, **engine_args},
                   "extra_args": ["--sim-time-scale", "20", "--sim-startup-seconds", "0.2"],
                   "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 60, "stop_grace_s": 5},
        "pacing": {"queue_band": [8, 32], "headroom": 8, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
        "queue": {"timeout_s": 60, "capacity": 4096},
        "control": {"mode": "auto", "journal_path": str(tmp_path / "decisions.jsonl")},  # back-off 2 s / 20
        "batch": {"dir": str(tmp_path / "batches")},
    }, "<worker-death>")  # fmt: skip
    pool = Supervisor(policy.engine)
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    st = app[PROXY]
    try:
        await _until(lambda: [w.state for w in pool.workers()] == [WorkerState.READY], 60, "worker ready")
        await _until(lambda: st.board.get("w0").sample is not None, 20, "first scrape")
        yield f"http://127.0.0.1:{port}", st
    finally:
        await runner.cleanup()  # stops the controller, then the worker
    assert [w.state for w in pool.workers()] == [WorkerState.STOPPED]


async def _kill_and_wait_revived(st: ProxyState) -> None:
    old = st.pool.get("w0").pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await _until(
        lambda: st.pool.get("w0").state is WorkerState.READY and st.pool.get("w0").pid not in (None, old),
        30,
        "worker revived",
    )


@pytest.mark.timeout(120)
async def test_killing_the_only_worker_under_load_fails_no_plain_request(tmp_path: Path) -> None:
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    sent = 0
    stop = asyncio.Event()
    async with (
        one_sim_worker(tmp_path) as (url, st),
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session,
    ):

        async def client(i: int) -> None:
            nonlocal sent
            while not stop.is_set():
                sent += 1
                body = {"model": MODEL, "prompt": f"client {i}", "max_tokens": 16, "sim_output_len": 16}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    statuses[resp.status] += 1
                    if resp.status != 200:
                        errors.append(await resp.text())

        clients = [asyncio.ensure_future(client(i)) for i in range(150)]
        try:
            for _ in range(3):
                served = statuses[200]
                await _until(lambda: statuses[200] >= served + 300, 30, "requests served")  # noqa: B023
                await _kill_and_wait_revived(st)
            served = statuses[200]
            await _until(lambda: statuses[200] >= served + 300, 30, "requests served after the last kill")
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert errors == []
    assert statuses[200] == sent and sum(statuses.values()) == sent  # every request answered, and with a 200
    retried = st.metrics.registry.get_sample_value("pacer_requests_retried_total", {"pool": "default"})
    assert retried is not None and retried > 0  # some were in flight at a kill and went back to the queue


@pytest.mark.timeout(60)
async def test_a_stream_that_sent_only_its_role_is_retried_whole(tmp_path: Path) -> None:
    """The chat stream's opening role event is held until content: a worker killed in between
    leaves nothing at the client, and the retry gives it one whole answer."""
    async with one_sim_worker(tmp_path, max_running_requests=1) as (url, st), aiohttp.ClientSession() as session:
        # a stream that occupies the worker's only running slot (its output has started)
        blocker = await session.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 100000, "sim_output_len": 100000, "stream": True},
        )
        assert blocker.status == 200
        await blocker.content.readline()

        async def chat() -> list[dict[str, object]]:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "sim_output_len": 5,
                "stream": True,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                return [orjson.loads(line[6:]) async for line in resp.content if line.startswith(b"data: {")]

        streamed = asyncio.ensure_future(chat())
        # the chat request waits in the worker's queue: the worker sent its role event, no content
        await _until(
            lambda: (
                st.board.get("w0").in_flight == 2
                and st.board.get("w0").sample is not None
                and st.board.get("w0").sample.queue == 1
            ),
            20,
            "chat request queued at the worker",
        )
        assert not streamed.done()  # nothing reached the client: not even the headers
        await _kill_and_wait_revived(st)
        chunks = await asyncio.wait_for(streamed, 30)
        blocker.close()
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d for d in deltas if "role" in d] == [{"role": "assistant", "content": ""}]  # one opening, not two
    assert sum(1 for d in deltas if d.get("content")) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
