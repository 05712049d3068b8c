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
from tests.harness.wait import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name


@contextlib.asynccontextmanager
async def one_sim_worker(
    tmp_path: Path, time_scale: float = 20, max_attempts: int = 3, **engine_args: object
) -> AsyncIterator[tuple[str, ProxyState]]:
    policy = parse_policy({
        "engine": {"kind": "sim", "workers": 1, "args": {"max_running_requests": 64, **engine_args},
                   "extra_args": ["--sim-time-scale", str(time_scale), "--sim-startup-seconds", "0.2"],
                   "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 60, "stop_grace_s": 5},
        "pacing": {"queue_band": [8, 32], "headroom": 8, "scrape_interval_s": 0.05, "stale_after_s": 1.0,
                   "max_attempts": max_attempts},
        "queue": {"timeout_s": 60, "capacity": 4096},
        # revivals only (a safety act, whatever the budget): no restart of the controller's own (the start-up
        # line's memory band, a plan) drains the worker beside a kill, so each death and revival is the test's
        "control": {"mode": "auto", "restarts_per_hour": 0,
                    "journal_path": str(tmp_path / "decisions.jsonl")},  # back-off 2 s / 20
        "batch": {"dir": str(tmp_path / "batches")},
    }, "<worker-death>")  # fmt: skip
    pool = Supervisor(policy.engine)
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    st = app[PROXY]
    try:
        await wait_until(lambda: [w.state for w in pool.workers()] == [WorkerState.READY], "worker ready", timeout=60)
        await wait_until(lambda: st.board.get("w0").sample is not None, "first scrape", timeout=20)
        yield f"http://127.0.0.1:{port}", st
    finally:
        await runner.cleanup()  # stops the controller, then the worker
    assert [w.state for w in pool.workers()] == [WorkerState.STOPPED]


async def _kill_and_wait_revived(st: ProxyState) -> None:
    """SIGKILL the worker and wait for another process of it to be READY: its death seen, the crash
    back-off (a second at most here), a start-up of about one; the deadline is for a starved CPU."""
    old = st.pool.get("w0").pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await wait_until(
        lambda: st.pool.get("w0").state is WorkerState.READY and st.pool.get("w0").pid not in (None, old),
        "worker revived",
        timeout=60,
        detail=lambda: _said(st),
    )


def _said(st: ProxyState) -> str:
    w = st.pool.get("w0")
    return f"w0 {w.state}, pid {w.pid}, {w.restarts} restart(s); last error: {(w.last_error or '')[-500:]}"


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
                await wait_until(lambda: statuses[200] >= served + 300, "requests served", timeout=30)  # noqa: B023
                await _kill_and_wait_revived(st)
            served = statuses[200]
            await wait_until(lambda: statuses[200] >= served + 300, "requests served after the last kill", timeout=30)
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
        await wait_until(
            lambda: (
                st.board.get("w0").in_flight == 2
                and st.board.get("w0").sample is not None
                and st.board.get("w0").sample.queue == 1
            ),
            "chat request queued at the worker",
            timeout=20,
        )
        assert not streamed.done()  # nothing reached the client: not even the headers
        await _kill_and_wait_revived(st)
        blocker.close()  # its answer would go on on the revived worker, in the only slot
        chunks = await asyncio.wait_for(streamed, 30)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d for d in deltas if "role" in d] == [{"role": "assistant", "content": ""}]  # one opening, not two
    assert sum(1 for d in deltas if d.get("content")) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(120)
async def test_a_worker_killed_mid_stream_cuts_no_plain_answer(tmp_path: Path) -> None:
    """The only worker SIGKILLed while streams and whole answers are half written: every plain one
    ends with its whole answer, one stream with the text from before the kill going on after it on
    the revived worker; a stream that cannot be continued (a penalty over its output) gets one error."""
    import openai

    length = 600
    streamed: dict[int, int] = {}  # request -> content events read so far
    async with one_sim_worker(tmp_path, time_scale=4) as (url, st):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        extra = {"sim_output_len": length}

        async def chat(i: int, **kw: object) -> tuple[str, str | None, int | None]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"chat {i}"}], max_tokens=8000, stream=True,
                stream_options={"include_usage": True}, extra_body=extra, **kw,  # type: ignore[arg-type]
            )  # fmt: skip
            text, reason, usage = [], None, None
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    text.append(c.choices[0].delta.content)
                    streamed[i] = len(text)
                reason = (c.choices[0].finish_reason if c.choices else None) or reason
                usage = c.usage.completion_tokens if c.usage else usage
            return "".join(text), reason, usage

        async def completion(i: int) -> tuple[str, str | None, int | None]:
            stream = await client.completions.create(
                model=MODEL, prompt=f"completion {i}", max_tokens=8000, stream=True, extra_body=extra
            )
            text, reason = [], None
            async for c in stream:
                if c.choices[0].text:
                    text.append(c.choices[0].text)
                    streamed[i] = len(text)
                reason = c.choices[0].finish_reason or reason
            return "".join(text), reason, len(text)

        async def whole(i: int) -> tuple[str, str | None, int | None]:
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"whole {i}"}], max_tokens=8000, extra_body=extra
            )
            assert answer.usage is not None
            return (
                answer.choices[0].message.content or "",
                answer.choices[0].finish_reason,
                answer.usage.completion_tokens,
            )

        plain = [chat(i) for i in range(6)] + [completion(i) for i in range(6, 12)] + [whole(i) for i in range(12, 18)]
        tasks = [asyncio.ensure_future(c) for c in plain]
        penalised = [asyncio.ensure_future(chat(i, frequency_penalty=0.5)) for i in range(18, 21)]
        # streams half written (the whole answers with them on the worker): then the kill
        await wait_until(
            lambda: sum(1 for n in streamed.values() if 5 <= n < length // 2) >= 8, "streams under way", timeout=60
        )
        broken = {i for i, n in streamed.items() if n < length}
        await _kill_and_wait_revived(st)
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        cut = await asyncio.gather(*penalised, return_exceptions=True)
        await client.close()
    for text, reason, written in answers:
        assert (reason, written) == ("stop", length) and text
    for i, outcome in zip(range(18, 21), cut, strict=True):  # one error each where the kill cut them, else whole
        cut_midstream = isinstance(outcome, openai.APIError) and "mid-stream" in str(outcome)
        if i in broken:
            assert cut_midstream, outcome
        else:  # read nothing before the kill: whole, or cut by text on its way to the client at the kill
            assert cut_midstream or (not isinstance(outcome, BaseException) and outcome[1:] == ("stop", length))
    went_on = st.metrics.registry.get_sample_value("pacer_requests_retried_total", {"pool": "default"})
    assert went_on is not None and went_on >= len(broken - set(range(18, 21))) >= 5  # they went on after the kill


@pytest.mark.timeout(60)
async def test_whole_answers_on_a_worker_that_dies_wait_for_it_to_come_back_without_spending_a_try(
    tmp_path: Path,
) -> None:
    """One try per request: answers half written when the only worker is SIGKILLed are not failed
    (502 "failed before any output"): their connection broke and the worker refuses new ones, so
    they wait for the revived worker, and each gets its whole answer."""
    async with one_sim_worker(tmp_path, time_scale=4, max_attempts=1) as (url, st), aiohttp.ClientSession() as session:

        async def whole(i: int) -> tuple[int, bytes]:
            body = {"model": MODEL, "prompt": f"whole {i}", "max_tokens": 400, "sim_output_len": 400}
            async with session.post(url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.read()

        tasks = [asyncio.ensure_future(whole(i)) for i in range(8)]
        await wait_until(lambda: st.board.get("w0").in_flight == 8, "answers on the worker", timeout=20)
        await _kill_and_wait_revived(st)
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 40)
    assert [status for status, _ in answers] == [200] * 8, [a for a in answers if a[0] != 200]
    assert all(orjson.loads(body)["usage"]["completion_tokens"] == 400 for _, body in answers)
