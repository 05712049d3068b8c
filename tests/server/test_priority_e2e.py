"""An interactive request overtakes batch work already queued on the worker: by the worker's own
scheduler where it orders by priority (``enable_priority_scheduling``), by the proxy's take-back on an
FCFS worker; a real ``pacer sim`` worker started by the supervisor, the ``openai`` client as the client."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def _queued_on_worker(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:num_queue_reqs"))


@pytest.mark.parametrize("priority_scheduling", [True, False])
async def test_interactive_overtakes_batch_queued_on_the_worker(tmp_path, priority_scheduling: bool) -> None:
    args = {"max_running_requests": 2, "enable_priority_scheduling": priority_scheduling}
    policy = parse_policy(
        {
            "engine": {
                "kind": "sim",
                "workers": 1,
                "args": args,
                "extra_args": ["--sim-time-scale", "20", "--sim-startup-seconds", "0.2"],
                "log_dir": str(tmp_path / "logs"),
                "startup_timeout_s": 60,
                "stop_grace_s": 5,
            },
            # a band that sends every batch request on: they queue on the worker, not in the proxy
            "pacing": {"queue_band": [16, 16], "headroom": 0, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
            # the planner would raise the running limit of 2 this test needs (a restart moves the port)
            "control": {"mode": "off"},
        },
        "<priority-e2e>",
    )
    pool = Supervisor(policy.engine)
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}/v1"
    batch = openai.AsyncOpenAI(
        base_url=base, api_key="none", max_retries=0, timeout=60, default_headers={"x-pacer-priority": "batch"}
    )
    inter = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    finished: list[str] = []

    async def ask(client: openai.AsyncOpenAI, name: str, tokens: int) -> None:
        await client.completions.create(
            model=MODEL, prompt=name, max_tokens=tokens, extra_body={"sim_output_len": tokens, "ignore_eos": True}
        )
        finished.append(name)

    try:

        async def ready() -> bool:
            return all(w.state is WorkerState.READY for w in pool.workers()) and len(pool.workers()) == 1

        await wait_until(ready, "the proxy and its worker ready", timeout=60)
        url = pool.workers()[0].url
        tasks = [asyncio.ensure_future(ask(batch, f"batch {i}", 2000)) for i in range(6)]

        async def four_queued() -> bool:
            return await _queued_on_worker(url) >= 4

        await wait_until(
            four_queued, "four requests queued on the worker", timeout=30
        )  # two run, four wait on the worker
        await ask(inter, "interactive", 4)
        await asyncio.gather(*tasks)
    finally:
        await batch.close()
        await inter.close()
        await runner.cleanup()
    assert len(finished) == 7
    # it went first, before any batch request finished: with priority scheduling the worker preempts a
    # running batch request for it; on an FCFS worker the proxy takes the batch requests beyond their
    # share back (the worker runs at most 2, read from its server info: a share of 1, less the chat's slot)
    assert finished[0] == "interactive"
