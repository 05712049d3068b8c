"""A real vLLM (the CPU build, 0.32.0) behind the whole proxy: front door, supervisor, controller.

The worker serves a tiny random Llama (tiny_model.py) from a cached environment (envs.py). Its KV
cache is made small on purpose, so the scheduler really preempts and a long ``max_model_len``
really does not fit: the signals the controller acts on come from vLLM itself, through the same
engine-neutral rules that tune SGLang.

Figures are measured on the engine side, from vLLM's own counters read just before and just after
each round of load (restart downtime counts in neither): preemptions per
thousand output tokens, output tokens per second while busy, and output tokens per CPU-second of
the worker's processes. The controller caps ``--max-num-seqs`` at the whole requests that fit the
KV cache (8,192 / (about 108 + 256) = 22), which ends the preemptions. It does not raise output
tokens per second on this CPU build, measured directly against vLLM in alternating rounds: vLLM
recomputes a preempted request at over 50,000 prompt tokens/s, about ten times cheaper per token
than decoding, and the KV cache already bounds the running batch at 128 to about 25, so a lower cap
only shrinks the batch (README, "Real engines"). The test asserts the preemption drop, the cap at
what fits, and guards throughput per CPU-second against a cap that would wreck it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.compose import build_app, serve
from proxy.control.constants import CONSTANTS
from proxy.engines.vllm.metrics import parse_metrics
from proxy.policy import ControlSettings, parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until
from tests.real.cpu import cpu_seconds
from tests.real.load import LoadResult, run_load

pytestmark = [pytest.mark.slow]

LAUNCHER = ("-m", "vllm.entrypoints.openai.api_server")
MODEL = "tiny"
# One KV token of the tiny model costs 512 bytes (tiny_model.py): 1 MiB holds 2,048 tokens, fewer
# once whole blocks are counted. 4,096 does not fit; vLLM names the length that does.
SMALL_KV_BYTES = 1 << 20
# no torch.compile: each start is about 15 s shorter on the CPU, and the scheduler is the same
EAGER = {"enforce_eager": True}
TOO_LONG = 4096


@dataclass
class Proxy:
    url: str
    state: ProxyState
    journal_path: Path

    async def decisions(self) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/admin/decisions") as r:
            assert r.status == 200, await r.text()
            return (await r.json())["decisions"]

    def worker(self):
        return self.state.pool.workers()[0]


@contextlib.asynccontextmanager
async def vllm_proxy(python: Path, model: Path, tmp_path: Path, *, args: dict, env: dict[str, str],
                     control: dict[str, Any]) -> AsyncIterator[Proxy]:  # fmt: skip
    journal = tmp_path / "decisions.jsonl"
    keys = {f.name for f in fields(ControlSettings)}
    policy = parse_policy(
        {
            "engine": {
                "kind": "vllm",
                "command": [str(python), *LAUNCHER],
                "args": {"model": str(model), "served_model_name": MODEL, "dtype": "bfloat16", **EAGER, **args},
                "env": {"HF_HUB_OFFLINE": "1", "VLLM_LOG_STATS_INTERVAL": "2", **env},
                "log_dir": str(tmp_path / "logs"),
                "startup_timeout_s": 600.0,
                "stop_grace_s": 15.0,
            },
            # every request may go to the worker at once: what happens next is vLLM's scheduling
            "pacing": {"queue_band": [1000, 5000], "headroom": 0, "scrape_interval_s": 0.5, "stale_after_s": 5.0},
            "queue": {"timeout_s": 900.0},
            "proxy": {"request_timeout_s": 900.0},
            "control": {
                "mode": "auto",
                "journal_path": str(journal),
                **{k: v for k, v in control.items() if k in keys},
            },
        },
        "<real-vllm>",
    )
    pool = Supervisor(policy.engine)
    # the rest of ``control``: the controller's constants (a real engine's clock is the wall's)
    constants = replace(CONSTANTS, **{k: v for k, v in control.items() if k not in keys})
    app = build_app(policy, pool, control_constants=constants)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        yield Proxy(url=f"http://127.0.0.1:{port}", state=app[PROXY], journal_path=journal)
    finally:
        await runner.cleanup()  # stops the controller, then the worker
    assert all(w.state is WorkerState.STOPPED for w in pool.workers())


def _tail(proxy: Proxy) -> Callable[[], str]:
    return lambda: "\n".join(proxy.state.pool.tail(proxy.worker().id, 30))  # type: ignore[attr-defined]


# -- start-up: a max_model_len the KV cache cannot hold ---------------------------------------------


@pytest.mark.timeout(1200)
async def test_refused_start_is_retried_with_a_max_model_len_that_fits(
    vllm_python: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the env var would override --kv-cache-memory-bytes (vllm/platforms/cpu.py)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    async with vllm_proxy(
        vllm_python, tiny_model, tmp_path,
        args={"max_model_len": TOO_LONG, "kv_cache_memory_bytes": SMALL_KV_BYTES, "max_num_seqs": 16}, env={},
        control={"crash_backoff_s": (0.5,)},
    ) as proxy:  # fmt: skip
        await wait_until(
            lambda: proxy.worker().restarts >= 1 and proxy.worker().state is WorkerState.READY,
            "the worker restarted and ready",
            timeout=900,
            detail=_tail(proxy),
        )
        worker = proxy.worker()
        assert worker.args["max_model_len"] < TOO_LONG
        assert f"--max-model-len {worker.args['max_model_len']}" in " ".join(worker.argv)

        (decision,) = [d for d in await proxy.decisions() if d["rule"] == "kv_capacity"]
        assert decision["status"] == "applied", decision
        assert decision["changes"] == {"max_model_len": [TOO_LONG, worker.args["max_model_len"]]}
        assert decision["evidence"]["max_context"] == TOO_LONG
        assert decision["evidence"]["estimated_max_context"] == worker.args["max_model_len"]
        assert "max seq len (4096)" in decision["evidence"]["log"]
        journaled = [json.loads(line) for line in proxy.journal_path.read_text().splitlines()]
        assert any(e["id"] == decision["id"] and e["rule"] == "kv_capacity" for e in journaled)

        # and it serves, through the proxy
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = await client.completions.create(model=MODEL, prompt="hello there", max_tokens=8)
        await client.close()
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 8
        assert reply.choices[0].text


# -- serving: preemptions under load ----------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """vLLM's own counters and the worker's CPU time at one instant."""

    time: float
    max_num_seqs: object
    generation_tokens: float
    preemptions: float
    cpu_s: float  # of the worker's process tree


async def snapshot(proxy: Proxy) -> Snapshot:
    worker = proxy.worker()
    assert worker.state is WorkerState.READY and worker.pid is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(worker.url + "/metrics", timeout=aiohttp.ClientTimeout(total=60)) as r,
    ):
        sample = parse_metrics(await r.text(), time.monotonic())
    return Snapshot(
        sample.time,
        worker.args.get("max_num_seqs"),
        sample.generation_tokens_total or 0.0,
        sample.retractions_total or 0.0,
        cpu_seconds(worker.pid),
    )


@dataclass(frozen=True)
class Era:
    """What the worker did during one round of load with one ``max_num_seqs``: the difference of
    its counters read just before and just after the round (two reads, so a test process starved
    of CPU by vLLM's busy threads cannot miss the round, as sampling every half second could)."""

    max_num_seqs: object
    busy_s: float
    cpu_s: float
    tokens: float
    preemptions: float

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Era:
        assert a.max_num_seqs == b.max_num_seqs and b.generation_tokens >= a.generation_tokens, (a, b)
        return cls(
            a.max_num_seqs,
            b.time - a.time,
            b.cpu_s - a.cpu_s,
            b.generation_tokens - a.generation_tokens,
            b.preemptions - a.preemptions,
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_s if self.busy_s else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s else 0.0

    @property
    def preemptions_per_1k_tokens(self) -> float:
        return 1000 * self.preemptions / self.tokens if self.tokens else 0.0


N_REQUESTS = 100  # the reference workload: about 108 prompt + 256 output tokens each, all at once
BEFORE_SEQS = 128


@pytest.mark.timeout(1800)
async def test_preemptions_lower_max_num_seqs(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    async with vllm_proxy(
        vllm_python, tiny_model, tmp_path,
        # 64 blocks of 128 tokens: 22 requests of ~108 + 256 tokens fit, 128 may run
        args={"max_num_seqs": BEFORE_SEQS, "max_model_len": 1024, "num_gpu_blocks_override": 64},
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        control={
            # 60 s of evidence after the worker is ready: the first round (8 s on a quiet host, about
            # 25 s on a busy one) runs on the policy's arguments from start to end, and the 90 s
            # window still holds all its preemptions when the rule may act
            "interval_s": 1.0, "window_s": 90.0, "min_evidence_s": 60.0, "retractions_per_min": 12.0,
            "cooldown_s": 1800.0,  # one restart in this test: the second round measures its effect
            "drain_timeout_s": 30.0, "bounds": {"max_num_seqs": [8]},
        },
    ) as proxy:  # fmt: skip
        await wait_until(
            lambda: proxy.worker().state is WorkerState.READY, "worker ready", timeout=600, detail=_tail(proxy)
        )
        await wait_until(
            lambda: proxy.state.board.get(proxy.worker().id).sample is not None, "first scrape", timeout=30
        )
        rounds: list[LoadResult] = []
        eras: list[Era] = []
        start = await snapshot(proxy)
        rounds.append(await run_load(proxy.url + "/v1", MODEL, n=N_REQUESTS, words=25, max_tokens=256, seed=1))
        eras.append(Era.between(start, await snapshot(proxy)))
        await wait_until(
            lambda: proxy.worker().restarts >= 1 and proxy.worker().state is WorkerState.READY,
            "the controller's restart",
            timeout=600,
            detail=_tail(proxy),
        )
        start = await snapshot(proxy)
        rounds.append(await run_load(proxy.url + "/v1", MODEL, n=N_REQUESTS, words=25, max_tokens=256, seed=2))
        eras.append(Era.between(start, await snapshot(proxy)))

        for i, r in enumerate(rounds):
            assert r.each_answered_once, (i, r.errors[:3], r.sent, len(r.answered))
            assert r.output_tokens == N_REQUESTS * 256

        worker = proxy.worker()
        after_seqs = worker.args["max_num_seqs"]
        assert isinstance(after_seqs, int) and after_seqs < BEFORE_SEQS
        storms = [d for d in await proxy.decisions() if d["rule"] == "retraction_storm" and d["status"] == "applied"]
        assert len(storms) == 1, await proxy.decisions()
        decision = storms[0]
        assert decision["changes"] == {"max_num_seqs": [BEFORE_SEQS, after_seqs]}
        assert decision["evidence"]["retraction_rate_per_min"] > 12.0
        assert decision["evidence"]["running_when_kv_full"] > 0
        # the cap is the number of whole requests the KV cache holds, from the requests that finished
        evidence = decision["evidence"]
        assert evidence["kv_capacity_tokens"] == 8192
        mean_tokens = (rounds[0].prompt_tokens + rounds[0].output_tokens) / N_REQUESTS
        assert abs(evidence["mean_request_tokens"] - mean_tokens) < 0.05 * mean_tokens, (evidence, mean_tokens)
        assert after_seqs == evidence["requests_that_fit"] == int(8192 // evidence["mean_request_tokens"])
        journaled = [json.loads(line) for line in proxy.journal_path.read_text().splitlines()]
        assert any(e["id"] == decision["id"] and e["changes"] == decision["changes"] for e in journaled)

        before, after = eras
        assert (before.max_num_seqs, after.max_num_seqs) == (BEFORE_SEQS, after_seqs)
        report = {
            "max_num_seqs": [BEFORE_SEQS, after_seqs],
            "engine_output_tokens_per_s": [round(before.tokens_per_s), round(after.tokens_per_s)],
            "engine_output_tokens_per_cpu_s": [round(before.tokens_per_cpu_s), round(after.tokens_per_cpu_s)],
            "preemptions_per_1k_output_tokens": [round(before.preemptions_per_1k_tokens, 2), round(after.preemptions_per_1k_tokens, 2)],
            "preemptions": [before.preemptions, after.preemptions],
            "busy_s": [round(before.busy_s, 1), round(after.busy_s, 1)],
            "client_rounds_output_tokens_per_s": [round(r.output_tokens_per_s) for r in rounds],
            "decision": decision["reason"],
        }  # fmt: skip
        print("vLLM before/after:", json.dumps(report), file=sys.stderr)
        assert before.busy_s > 2 and after.busy_s > 2, report
        assert after.preemptions_per_1k_tokens < before.preemptions_per_1k_tokens / 5, report
        # a guard, not a gain (see the module docstring): measured directly, the cap at what fits
        # keeps about 0.85 of the throughput per CPU-second at 128 (0.75 under load); in one fresh-clone
        # CI run, 0.51 (rounds of 4 and 7.5 busy seconds). A cap near 1 would keep a small part of it
        assert after.tokens_per_cpu_s > 0.4 * before.tokens_per_cpu_s, report
