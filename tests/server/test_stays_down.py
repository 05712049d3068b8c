"""A worker that dies where the policy revives nothing (``control.mode = "off"``): the requests it
had, and every request after, are answered 503 ``no_worker`` at once, saying why, instead of each
waiting out ``queue.timeout_s`` for a worker that will not come; an operator's restart brings it
back and requests flow again. A worker in a crash loop no rule breaks (an unknown flag): its
requests are refused at once too, with a ``Retry-After``, while the controller goes on reviving it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai

from proxy.workers.base import WorkerState
from tests.harness.sim_proxy import serve_sims
from tests.harness.wait import wait_until
from tests.server.test_e2e_sim import MODEL

QUEUE_TIMEOUT_S = 120  # far longer than the test: an answer before it is the proxy's own


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


async def test_requests_for_a_worker_that_stays_down_are_refused_at_once(tmp_path: Path) -> None:
    control = {"mode": "off", "journal_path": str(tmp_path / "decisions.jsonl")}
    async with serve_sims(tmp_path, {"workers": 1}, queue={"timeout_s": QUEUE_TIMEOUT_S}, control=control) as p:
        pool, st = p.pool, p.state
        async with _client(p.url) as client:
            await wait_until(
                lambda: pool.get("w0").state is WorkerState.READY,
                "pool.get('w0').state is WorkerState.READY",
                timeout=60,
            )
            # long (many seconds at the worker's 20 x): still running when the worker is killed
            body = {"sim_output_len": 40000}
            on_it = asyncio.ensure_future(
                client.completions.create(model=MODEL, prompt="x", max_tokens=40000, extra_body=body)
            )
            await wait_until(lambda: st.board.get("w0").in_flight == 1, "st.board.get('w0').in_flight == 1", timeout=20)
            started = time.monotonic()
            os.kill(pool.get("w0").pid, signal.SIGKILL)
            await wait_until(lambda: pool.get("w0").stays_down, "pool.get('w0').stays_down", timeout=20)
            errors = []
            try:
                await on_it
            except openai.APIStatusError as e:
                errors.append(e)
            try:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            except openai.APIStatusError as e:
                errors.append(e)
            # at once: not the queue's timeout (the bound is loose for a starved CPU, far below that timeout)
            assert time.monotonic() - started < QUEUE_TIMEOUT_S / 2
            assert [(e.status_code, e.code) for e in errors] == [(503, "no_worker")] * 2
            message = errors[1].message
            assert "(w0 down (killed by SIGKILL), stays down)" in message, message
            assert "Decode batch" not in message  # what the worker printed is the operator's to read, not a client's
            assert "stays down (control.mode = off)" in (pool.get("w0").last_error or "")  # pacer status shows it
            assert "retry-after" not in errors[1].response.headers  # only an operator brings it back
            registry = st.metrics.registry
            assert (
                registry.get_sample_value("pacer_requests_failed_total", {"pool": "default", "reason": "no_worker"})
                == 1
            )
            assert registry.get_sample_value("pacer_requests_rejected_total", {"reason": "no_worker"}) == 1

            await pool.restart("w0", pool.get("w0").args, "the operator's restart")  # its next launch lifts it
            assert pool.get("w0").state is WorkerState.READY and not pool.get("w0").stays_down
            await wait_until(
                lambda: st.board.get("w0").sample is not None, "st.board.get('w0').sample is not None", timeout=20
            )
            again = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body={"sim_output_len": 2}
            )
            assert again.usage.completion_tokens == 2
            pool.declare_down("w0", "it stays down")  # a worker that serves is not given up
            assert not pool.get("w0").stays_down


async def test_requests_for_a_worker_in_a_crash_loop_are_refused_with_a_retry_after(tmp_path: Path) -> None:
    control = {"mode": "auto", "journal_path": str(tmp_path / "decisions.jsonl")}
    queue = {"timeout_s": QUEUE_TIMEOUT_S, "retry_after_s": 9}
    # its clock 20 x the wall's: the crash back-off (2, 5, 15 s of it) 0.1, 0.25, 0.75 s
    extra_args = ["--sim-time-scale", "20", "--no-such-flag"]
    async with serve_sims(tmp_path, {"workers": 1, "extra_args": extra_args}, queue=queue, control=control) as p:
        pool = p.pool
        async with _client(p.url) as client:
            await wait_until(lambda: pool.get("w0").crash_loop, "pool.get('w0').crash_loop", timeout=60)
            started = time.monotonic()
            try:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
                raise AssertionError("answered by a worker that cannot start")
            except openai.APIStatusError as e:
                refused = e
            assert time.monotonic() - started < QUEUE_TIMEOUT_S / 2  # at once, not the queue's timeout
            assert (refused.status_code, refused.code) == (503, "no_worker")
            assert refused.response.headers["retry-after"] == "9"  # the controller revives it: come back
            message = refused.message
            assert "every worker is down or in a crash loop" in message and ", in a crash loop)" in message, message
            assert "--no-such-flag" not in message  # the worker's output is in pacer status, not told a client
            assert "unrecognized arguments: --no-such-flag" in (pool.get("w0").last_error or "")
            await wait_until(  # the revivals go on (each a start-up that fails, after the crash back-off)
                lambda: pool.get("w0").restarts >= 3, "pool.get('w0').restarts >= 3", timeout=60
            )
