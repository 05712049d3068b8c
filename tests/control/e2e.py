"""The whole proxy (front door, supervisor, controller) in front of real ``pacer sim`` processes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import openai

from proxy.compose import build_app, serve
from proxy.control.constants import CONSTANTS, Constants
from proxy.policy import ControlSettings, parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name


@dataclass
class Proxy:
    url: str
    state: ProxyState
    journal_path: Path
    app: Any

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    @property
    def controller(self):
        return self.app[PROXY].controllers["default"]

    async def decisions(self) -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/admin/decisions") as r:
            assert r.status == 200
            return (await r.json())["decisions"]

    async def worker_metric(self, worker_id: str, name: str) -> float:
        url = self.state.pool.get(worker_id).url
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " "))
        )


def in_engine_seconds(wall: dict[str, Any], rate: float) -> Constants:
    """The controller's constants with ``wall`` (durations in wall seconds, rates per wall minute)
    taken to the engine's clock of a worker running ``rate`` times the wall's."""
    k = CONSTANTS.in_wall(rate)
    return replace(k, **wall).in_wall(1.0 / rate)


@contextlib.asynccontextmanager
async def running_proxy(
    tmp_path: Path,
    *,
    args: dict[str, Any],
    extra_args: list[str],
    control: dict[str, Any],
    pacing: dict[str, Any] | None = None,
    workers: int = 1,
) -> AsyncIterator[Proxy]:
    """``control``: [control] keys and, for the rest, the controller's constants as the test wants them
    on the wall clock (converted here to the engine's seconds with the worker's time scale)."""
    journal = tmp_path / "decisions.jsonl"
    keys = {f.name for f in dataclasses.fields(ControlSettings)}
    policy = parse_policy({
        "engine": {"kind": "sim", "workers": workers, "args": args,
                   "extra_args": ["--sim-startup-seconds", "0.2", *extra_args],
                   "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 60, "stop_grace_s": 5},
        "pacing": pacing or {"queue_band": [32, 64], "headroom": 8, "scrape_interval_s": 0.1, "stale_after_s": 1.0},
        "queue": {"timeout_s": 240},
        "control": {"journal_path": str(journal), **{k: v for k, v in control.items() if k in keys}},
    }, "<e2e-control>")  # fmt: skip
    rate = policy.engine.engine.modelled(policy.engine.args, policy.engine.extra_args).clock_rate
    pool = Supervisor(policy.engine)
    app = build_app(policy, pool, control_constants=in_engine_seconds(
        {k: v for k, v in control.items() if k not in keys}, rate))  # fmt: skip
    runner, port = await serve(app, "127.0.0.1", 0)
    st = app[PROXY]
    try:
        await wait_until(
            lambda: len(pool.workers()) == workers and all(w.state is WorkerState.READY for w in pool.workers()),
            "workers ready",
            timeout=60,
        )
        await wait_until(
            lambda: all(st.board.get(w.id).sample is not None for w in pool.workers()), "first scrape", timeout=20
        )
        yield Proxy(url=f"http://127.0.0.1:{port}", state=st, journal_path=journal, app=app)
    finally:
        await runner.cleanup()  # stops the controller, then the workers
    assert all(w.state is WorkerState.STOPPED for w in pool.workers())
