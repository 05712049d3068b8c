"""Decode out of memory, end to end: a simulated SGLang worker with almost no memory left for
activations (``--mem-fraction-static 0.98``) and CUDA graphs only for small batches dies of a CUDA
OOM in decode once its running batch grows past ~170 requests. Its KV pool is nearly empty then
(short requests on an 80 GB H100): the controller reads the traceback (decode) and the pool's usage,
revives the worker with a smaller fraction (the pool's memory to the activations) and the running
cap it had, and every request is answered in full."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.workers.base import WorkerState

from .e2e import MODEL, running_proxy

N_REQUESTS = 320
OUTPUT_TOKENS = 200


async def test_decode_oom_caps_the_running_batch_and_nothing_is_lost(tmp_path: Path) -> None:
    async with running_proxy(
        tmp_path,
        # 0.98 of an 80 GB H100 leaves ~1.08 GB for activations: a decode batch outside the CUDA graphs
        # (max bs 8 here) needs 1.25 MiB per request as the twin models it, so its 200 fit; the worker's
        # activations are five times that (a factor the twin is not told), so more than ~170 running is
        # an OOM (a prefill chunk of 512 needs 640 MiB: it fits)
        args={
            "mem_fraction_static": 0.98,
            "chunked_prefill_size": 512,
            "cuda_graph_max_bs_decode": 8,
            "max_running_requests": 200,
        },
        extra_args=["--sim-time-scale", "5", "--sim-activation-factor", "5"],
        control={"mode": "auto", "interval_s": 0.5, "crash_backoff_s": [0.5], "available_mem_band_gb": [0.1, 80]},
        pacing={"queue_band": [64, 128], "headroom": 16, "scrape_interval_s": 0.1, "stale_after_s": 1.0},
    ) as proxy:
        pool = proxy.state.pool
        worker = pool.workers()[0].id
        first_pid = pool.get(worker).pid
        client = proxy.client()
        sem = asyncio.Semaphore(N_REQUESTS)

        async def one(i: int) -> int:
            async with sem:
                r = await client.completions.create(
                    model=MODEL,
                    prompt=f"short prompt {i}",
                    max_tokens=OUTPUT_TOKENS,
                    extra_body={"sim_output_len": OUTPUT_TOKENS},
                )
                return r.usage.completion_tokens

        results = await asyncio.gather(*[one(i) for i in range(N_REQUESTS)])
        await client.close()
        assert results == [OUTPUT_TOKENS] * N_REQUESTS  # nothing lost

        decisions = await proxy.decisions()
        ooms = [d for d in decisions if d["rule"] in ("decode_oom", "prefill_oom")]
        assert len(ooms) == 1, ooms  # one death: the batch the cap allows fits the memory given back
        (oom,) = ooms
        assert oom["rule"] == "decode_oom" and oom["status"] == "applied", oom
        assert oom["reason"].startswith("worker died (out of memory in decode)")
        assert oom["evidence"]["peak_running"] > 8 and oom["evidence"]["peak_token_usage"] <= 0.5
        ((old, new),) = [tuple(v) for k, v in oom["changes"].items() if k == "mem_fraction_static"]
        assert old == 0.98 and 0.95 < new < 0.98 and set(oom["changes"]) == {"mem_fraction_static"}

        info = pool.get(worker)
        assert info.state is WorkerState.READY and info.pid != first_pid
        assert info.args["max_running_requests"] == 200 and info.args["mem_fraction_static"] == new
        assert info.restarts == 1 and len(proxy.controller.state(worker).deaths) == 1
        tail = pool.tail(worker, 5000)
        since_ready = tail[max(i for i, line in enumerate(tail) if "ready to roll" in line) :]
        assert any("Decode batch" in line for line in since_ready)
        assert not any("OutOfMemoryError" in line for line in since_ready)
