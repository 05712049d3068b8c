"""Chat beside a batch, through the proxy in front of a real ``pacer sim`` worker: the protection is on
with no [pacing] key for it, its numbers read from the worker's own server info."""

from __future__ import annotations

import asyncio

import aiohttp
import openai

from proxy.workers.base import WorkerState
from tests.harness.sim_proxy import FAST_SIM, serve_sims
from tests.harness.wait import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name
LONG = 6000  # batch answers long enough that none ends while the chat request is answered


async def test_a_chat_request_after_a_batch_filled_the_worker_gets_a_running_slot(tmp_path) -> None:
    """The worker runs at most 8 requests (a flag the policy's args do not name: the proxy reads it from
    ``/server_info``). A batch fills it (8 running, 2 waiting); a streamed chat request then takes the
    batch's newest requests back beyond its share (8 less a reserve of 1, less a slot for the chat) and is
    answered while every batch request still runs; each batch request is then answered whole, once."""
    pacing = {"queue_band": [4, 16], "headroom": 4, "scrape_interval_s": 0.05, "stale_after_s": 1.0}
    engine = {"extra_args": [*FAST_SIM, "--max-running-requests", "8"]}
    async with serve_sims(tmp_path, engine, pacing=pacing) as p:
        st = p.state
        await wait_until(
            lambda: [w.state for w in p.pool.workers()] == [WorkerState.READY], "the worker ready", timeout=60
        )
        load = st.board.get(p.pool.workers()[0].id)
        await wait_until(lambda: load.running_limit is not None, "the worker's running limit read")
        assert load.running_limit == 8
        client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="none", max_retries=0, timeout=120)
        async with client:
            batch = [
                asyncio.create_task(
                    client.completions.create(
                        model=MODEL,
                        prompt=f"job {i}",
                        max_tokens=LONG,
                        extra_body={"sim_output_len": LONG},
                        extra_headers={"x-pacer-priority": "batch"},
                    )
                )
                for i in range(10)
            ]
            await wait_until(  # 8 run, 2 wait there
                lambda: load.batch_in_flight == 10 and load.last_running == 8, "the batch on the worker, 8 running"
            )
            stream = await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=8, stream=True, extra_body={"sim_output_len": 8}
            )
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            assert text and not any(t.done() for t in batch)  # it did not wait for a batch request to end
            async with aiohttp.ClientSession() as http, http.get(p.url + "/metrics") as r:
                metrics = await r.text()
            taken = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("pacer_requests_requeued_total"))  # fmt: skip
            assert taken >= 3  # 10 batch + 1 chat against a share of 7: the newest batch requests went back
            answers = await asyncio.gather(*batch)
        assert [a.usage.completion_tokens for a in answers] == [LONG] * 10
