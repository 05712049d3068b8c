"""A real vLLM (the CPU build, 0.32.0) behind the supervisor and the controller.

The worker serves a tiny random Llama (tiny_model.py) from a cached environment (envs.py). Its KV
cache is made small on purpose, so the scheduler really preempts and a long ``max_model_len``
really does not fit: the signals the controller acts on come from vLLM itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.engines.base import EventKind, LogEvent
from proxy.engines.vllm.knobs import fitting_max_model_len
from proxy.engines.vllm.logs import parse_line
from proxy.policy import Policy, parse_policy
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor

pytestmark = [pytest.mark.slow]

LAUNCHER = ("-m", "vllm.entrypoints.openai.api_server")
# One KV token of the tiny model costs 512 bytes (tiny_model.py): 1 MiB holds 2,048 tokens, fewer
# once whole blocks are counted. 4,096 does not fit; vLLM names the length that does.
SMALL_KV_BYTES = 1 << 20
TOO_LONG = 4096


def vllm_policy(python: Path, model: Path, log_dir: Path, args: dict, env: dict[str, str], **control: object) -> Policy:
    return parse_policy(
        {
            "engine": {
                "kind": "vllm",
                "command": [str(python), *LAUNCHER],
                "args": {"model": str(model), "served_model_name": "tiny", "dtype": "bfloat16", **args},
                "env": {"HF_HUB_OFFLINE": "1", "VLLM_LOG_STATS_INTERVAL": "2", **env},
                "log_dir": str(log_dir),
                "startup_timeout_s": 600.0,
                "stop_grace_s": 15.0,
            },
            "control": {"mode": "off", **control},
        },
        "<test>",
    )


class EventLog:
    """Every line of every worker through the vLLM log parser."""

    def __init__(self) -> None:
        self.events: list[LogEvent] = []
        self.lines = 0

    def __call__(self, worker_id: str, line: str) -> None:
        self.lines += 1
        event = parse_line(line, asyncio.get_running_loop().time())
        if event is not None:
            self.events.append(event)

    def of(self, kind: EventKind) -> list[LogEvent]:
        return [e for e in self.events if e.kind == kind]


@pytest.mark.timeout(900)
async def test_vllm_refuses_a_max_model_len_its_kv_cache_cannot_hold(vllm_python: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the env var would override --kv-cache-memory-bytes (vllm/platforms/cpu.py)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    policy = vllm_policy(
        vllm_python, tiny_model, tmp_path / "logs",
        {"max_model_len": TOO_LONG, "kv_cache_memory_bytes": SMALL_KV_BYTES, "max_num_seqs": 16}, {},
    )  # fmt: skip
    sup = Supervisor(policy.engine)
    log = EventLog()
    sup.add_line_listener(log)
    try:
        await sup.start()
        (worker,) = sup.workers()
        assert worker.state == WorkerState.DOWN, worker
        refusals = log.of(EventKind.KV_CAPACITY_ERROR)
        assert refusals, f"no KV capacity error among {log.lines} lines:\n" + "\n".join(sup.tail("w0", 20))
        fields = refusals[-1].fields
        assert fields["max_model_len"] == TOO_LONG
        estimated = int(fields["estimated_max_model_len"])
        assert 0 < estimated < TOO_LONG
        assert log.of(EventKind.CRASH), "the API server's wrapper error follows the root cause"

        # what the controller does with it: the longest block-aligned length that fits
        fitted = fitting_max_model_len(estimated)
        worker = await sup.restart("w0", {**worker.args, "max_model_len": fitted}, reason="KV capacity")
        assert worker.state == WorkerState.READY, sup.tail("w0", 20)
        assert f"--max-model-len {fitted}" in " ".join(worker.argv)
        startup = log.of(EventKind.STARTUP)[-1]
        assert startup.fields["max_model_len"] == fitted
        assert startup.fields["max_total_tokens"] >= fitted
    finally:
        await sup.stop()
