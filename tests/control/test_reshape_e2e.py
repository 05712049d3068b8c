"""A reshape in ``auto``, end to end: the proxy in front of real ``pacer sim`` processes.

A pool of two simulated RTX 4090s (PCIe, no NVLink) serves a 1B model as one tp-2 worker, with
``reshape = true``; 48 clients keep work waiting in the proxy's queue. The twin prices two tp-1
replicas far above one tp-2 worker (the all-reduces and the logits' gather cross PCIe every step),
so the controller reshapes the pool: it drains the tp-2 worker (what it runs finishes or goes back
to the proxy's queue) and starts two tp-1 workers on its GPUs. Every request is answered in full,
none fails, and the pool ends as two tp-1 workers, one GPU each.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import openai

from proxy.compose import build_app, serve
from proxy.policy import ControlSettings, parse_policy
from proxy.server.state import PROXY
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor
from tests.control.e2e import in_engine_seconds
from tests.harness.wait import wait_until

MODEL = "tiny"
SCALE = 30.0  # the workers' clock runs this many times the wall's
# each answer runs some 60 ms of wall time: answers that short (48 tokens, 11 ms) left the worker idle
# between two scrapes' dispatches, and a reshape could find nothing running on it
OUTPUT = 256
# on the wall clock: a look every 0.1 s, a shape looked at every 0.5 s once 0.5 s of evidence is in
WALL = {"interval_s": 0.1, "window_s": 2.0, "min_evidence_s": 0.5, "plan_interval_s": 0.5, "cooldown_s": 0.5,
        "drain_timeout_s": 5.0, "drain_settle_s": 1.0}  # fmt: skip


def _policy(tmp_path: Path) -> Any:
    control = {"mode": "auto", "reshape": True, "restarts_per_hour": 0}  # no plan restarts: only the reshape
    return parse_policy({
        "pool": [{
            "name": "tiny", "model": MODEL, "kind": "sim", "tp": 2, "gpus": [0, 1],
            "extra_args": ["--sim-gpu", "rtx4090-24gb", "--sim-model", "llama-3.2-1b", "--sim-time-scale", str(SCALE),
                           "--sim-startup-seconds", "0.2"],
            "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 60, "stop_grace_s": 5,
            "control": control,
        }],
        "pacing": {"queue_band": [4, 16], "headroom": 4, "scrape_interval_s": 0.1, "stale_after_s": 1.0},
        "queue": {"timeout_s": 240},
        "control": {"journal_path": str(tmp_path / "decisions.jsonl")},  # the proxy's one journal
    }, "<e2e-reshape>")  # fmt: skip


async def _load(url: str, stop: asyncio.Event, answers: list[int], failures: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one_client() -> None:
        while not stop.is_set():
            try:
                r = await client.completions.create(model=MODEL, prompt="say something long", max_tokens=OUTPUT,
                                                    extra_body={"sim_output_len": OUTPUT})  # fmt: skip
                answers.append(r.usage.completion_tokens if r.usage else 0)
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    await asyncio.gather(*(one_client() for _ in range(48)))
    await client.close()


async def test_auto_reshapes_a_tp2_worker_into_two_tp1_workers_losing_nothing(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    assert policy.pools[0].control.reshape and {f.name for f in dataclasses.fields(ControlSettings)} >= {"reshape"}
    pool = Supervisor(policy.pools[0].engine, placement=_placement(policy))
    app = build_app(policy, pool, control_constants=in_engine_seconds(WALL, SCALE))
    runner, port = await serve(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    stop, answers, failures = asyncio.Event(), [], []
    try:
        await wait_until(
            lambda: [w.state for w in pool.workers()] == [WorkerState.READY], "the tp-2 worker", timeout=60
        )
        load = asyncio.create_task(_load(url, stop, answers, failures))

        def reshaped() -> list[dict[str, Any]]:
            entries = app[PROXY].journal.entries() if app[PROXY].journal is not None else []
            return [e for e in entries if e["rule"] == "reshape" and e["status"] in ("applied", "failed")]

        (entry,) = await wait_until(reshaped, "the reshape is carried out", timeout=120, every=0.1)
        await wait_until(lambda: len(answers) >= 100, "answers from the new shape", timeout=60)
        stop.set()
        await load
        workers = pool.workers()
    finally:
        stop.set()
        await runner.cleanup()
    assert entry["status"] == "applied", entry
    assert entry["best_shape"] == "2 x tp 1" and entry["current_shape"] == "1 x tp 2"
    assert entry["predicted_gain"] >= 0.1 and entry["evidence"]["work_waits"] is True
    (step,) = entry["act"]["steps"]
    assert step["old"] == ["tiny-w0"] and sorted(step["new"]) == ["tiny-w0", "tiny-w1"]
    (drain,) = step["drains"]
    assert drain["in_flight_at_drain"] > 0, entry  # the reshape came while requests ran: none of them is lost
    assert sorted((w.id, w.gpus, w.args["tp_size"]) for w in workers) == [("tiny-w0", (0,), 1), ("tiny-w1", (1,), 1)]
    assert all(w.state is WorkerState.READY for w in workers)
    assert failures == [] and len(answers) >= 100 and set(answers) == {OUTPUT}  # nothing lost, nothing cut short


def _placement(policy: Any) -> Any:
    from proxy.workers.fleet import placement_of

    pool = policy.pools[0]
    return placement_of(pool, policy.placement(None)[pool.name])
