"""Prefill out of memory, end to end: a simulated SGLang worker whose ``--mem-fraction-static``
leaves too little room for the activations of an 8192-token prefill chunk dies with SGLang's CUDA
OOM traceback on the first long prompts. The controller reads the traceback (prefill), revives the
worker with ``--chunked-prefill-size 4096``, it does not die again, and the requests that had
produced no output are retried: every one is answered in full."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxy.workers.base import WorkerState
from tests.harness.wait import wait_until

from .e2e import MODEL, running_proxy

N_REQUESTS = 40
PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 64


def long_prompt(i: int) -> str:
    # one token per piece of up to four characters: PROMPT_TOKENS tokens, no prefix shared across requests
    return " ".join(f"{(i * 7919 + j * 31) % 10000:04d}" for j in range(PROMPT_TOKENS))


async def _send_all(proxy: Any) -> list[Any]:
    """The N_REQUESTS long prompts at once, through the openai client."""
    client = proxy.client()
    try:
        return await asyncio.gather(*[
            client.completions.create(model=MODEL, prompt=long_prompt(i), max_tokens=OUTPUT_TOKENS,
                                      extra_body={"sim_output_len": OUTPUT_TOKENS})
            for i in range(N_REQUESTS)
        ])  # fmt: skip
    finally:
        await client.close()


async def test_prefill_oom_is_fixed_with_a_smaller_chunk_and_nothing_is_lost(tmp_path: Path) -> None:
    async with running_proxy(
        tmp_path,
        # 8192 prefill tokens need 2 GB as the twin models them: its start-up forecast keeps 1.5 x that
        # free (0.96 of an 80 GB H100 leaves ~2.6 GB: lowered to ~3 GB). The worker's activations are
        # twice the model's (a factor the twin is not told): 4 GB, an OOM; 4096 need 2 GB, which fit
        args={"mem_fraction_static": 0.96, "chunked_prefill_size": 8192, "max_running_requests": 64},
        extra_args=["--sim-time-scale", "5", "--sim-activation-factor", "2"],
        control={"mode": "auto", "interval_s": 0.5, "crash_backoff_s": [0.5], "available_mem_band_gb": [1.0, 80]},
    ) as proxy:
        pool = proxy.state.pool
        worker = pool.workers()[0].id
        first_pid = pool.get(worker).pid
        results = await _send_all(proxy)

        # nothing lost: every request answered once, in full, after the retry on the revived worker
        assert [r.usage.completion_tokens for r in results] == [OUTPUT_TOKENS] * N_REQUESTS
        assert all(r.usage.prompt_tokens == PROMPT_TOKENS for r in results)
        assert proxy.state.metrics.registry.get_sample_value("pacer_requests_retried_total", {"pool": "default"}) >= 1

        decisions = await proxy.decisions()
        [oom] = [d for d in decisions if d["rule"] == "prefill_oom"]
        assert oom["status"] == "applied", oom
        assert oom["changes"] == {"chunked_prefill_size": [8192, 4096]}
        assert oom["reason"].startswith("worker died (out of memory in prefill)")
        assert oom["evidence"]["oom_phase"] == "prefill"
        assert oom["evidence"]["log"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")

        # its start-up line (2.6 GB free) was below what a chunk of 8192 needs by the twin with margin (3
        # GB): memory_low, read at the controller's next look (on a loaded machine the first prefill may
        # die before it); it died once, came back with the smaller chunk and did not die again
        rules = [d["rule"] for d in decisions if d["rule"] != "output_budget"]
        assert rules.count("prefill_oom") == 1 and set(rules) <= {"memory_low", "prefill_oom"}, rules
        info = pool.get(worker)
        assert info.state is WorkerState.READY and info.pid != first_pid
        assert info.args["chunked_prefill_size"] == 4096 and info.restarts == len(rules)  # each rule: one restart
        assert len(proxy.controller.state(worker).deaths) == 1
        tail = pool.tail(worker, 2000)
        since_ready = tail[max(i for i, line in enumerate(tail) if "ready to roll" in line) :]
        assert any("Prefill batch" in line for line in since_ready)
        assert not any("OutOfMemoryError" in line for line in since_ready)
        await wait_until(
            lambda: not [d for d in proxy.controller.journal.entries() if d["status"] == "acting"],
            "journal settled",
        )


async def test_the_chunk_that_does_not_fit_is_lowered_from_the_start_up_line(tmp_path: Path) -> None:
    """The same worker with no GPU named on its command line (the forecast before the launch is off:
    the twin cannot vouch for its GPU), its start-up line read as it serves: its twin's activations for a full 8192-token chunk (2 GB) do
    not fit the ~1.8 GB the start-up line reports free, so the worker is restarted with 4096 before
    it serves anything, and it never dies: every request answered, none retried."""
    async with running_proxy(
        tmp_path,
        args={"mem_fraction_static": 0.97, "chunked_prefill_size": 8192, "max_running_requests": 64},
        extra_args=["--sim-time-scale", "5"],
        control={
            "mode": "auto",
            "interval_s": 0.5,
            "crash_backoff_s": [0.5],
            "available_mem_band_gb": [1.0, 80],
        },
    ) as proxy:
        pool = proxy.state.pool
        worker = pool.workers()[0].id
        await wait_until(lambda: pool.get(worker).args.get("chunked_prefill_size") == 4096
                         and pool.get(worker).state is WorkerState.READY, "restarted with the chunk that fits",
                         timeout=30)  # fmt: skip
        results = await _send_all(proxy)
        assert [r.usage.completion_tokens for r in results] == [OUTPUT_TOKENS] * N_REQUESTS
        assert not proxy.state.metrics.registry.get_sample_value("pacer_requests_retried_total", {"pool": "default"})

        [fit] = [d for d in await proxy.decisions() if d["rule"] == "activations_fit"]
        assert fit["status"] == "applied" and fit["changes"] == {"chunked_prefill_size": [8192, 4096]}
        assert fit["evidence"]["need_gb"] == 2.0 and fit["evidence"]["available_gpu_mem_gb"] < 2.0
        assert not [d for d in await proxy.decisions() if d["rule"] == "prefill_oom"]
        assert not proxy.controller.state(worker).deaths
        tail = pool.tail(worker, 2000)
        assert not any("OutOfMemoryError" in line for line in tail)


async def test_with_the_forecast_the_first_launch_already_takes_the_chunk_that_fits(tmp_path: Path) -> None:
    """The same worker with the GPU it models named on its command line: the twin prints the start-up line it would print,
    SGLang's log reader reads it, and the worker is launched with 4096 from the start: no restart, no
    death, the worker's own start-up line agrees."""
    async with running_proxy(
        tmp_path,
        args={"mem_fraction_static": 0.97, "chunked_prefill_size": 8192, "max_running_requests": 64},
        extra_args=["--sim-time-scale", "5", "--sim-gpu", "h100-80gb"],  # the GPU it models, named
        control={"mode": "auto", "interval_s": 0.5, "available_mem_band_gb": [1.0, 80]},
    ) as proxy:
        pool = proxy.state.pool
        worker = pool.workers()[0].id
        info = pool.get(worker)
        assert info.state is WorkerState.READY and info.restarts == 0
        assert info.args["chunked_prefill_size"] == 4096 and "--chunked-prefill-size" in info.argv
        assert info.argv[info.argv.index("--chunked-prefill-size") + 1] == "4096"
        [fit] = await proxy.decisions()
        assert fit["rule"] == "activations_fit" and fit["status"] == "applied"
        assert fit["changes"] == {"chunked_prefill_size": [8192, 4096]}
        assert fit["detail"].startswith("before its first launch")
        assert any("chunked_prefill_size=4096" in line for line in pool.tail(worker, 2000))

        results = await _send_all(proxy)
        assert [r.usage.completion_tokens for r in results] == [OUTPUT_TOKENS] * N_REQUESTS
        assert not proxy.state.metrics.registry.get_sample_value("pacer_requests_retried_total", {"pool": "default"})
        assert not proxy.controller.state(worker).deaths and pool.get(worker).restarts == 0
        # no other engine argument moved (an output budget, set from the first answers, is no restart)
        assert [d["rule"] for d in await proxy.decisions() if d["rule"] != "output_budget"] == ["activations_fit"]
