"""A managed pool (simulated workers the proxy starts, placed on GPUs) beside an external pool
(a server someone else runs) behind one proxy: one Fleet, each pool its own queue and controller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.fleet import Fleet, PoolView, build_pool
from tests.harness.fake_engine import MODEL as EXTERNAL_MODEL
from tests.harness.fake_engine import FakeEngine
from tests.harness.wait import wait_until

SIM_MODEL = "sim-small"


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[tuple[str, ProxyState, FakeEngine]]:
    fake = FakeEngine()
    url = await fake.start()
    policy = parse_policy(
        {
            "control": {"mode": "auto", "journal_path": str(tmp_path / "decisions.jsonl")},
            "pool": [
                {
                    "name": "local",
                    "model": SIM_MODEL,
                    "kind": "sim",
                    "tp": 2,
                    "gpus": [2, 3, 0, 1],
                    "extra_args": ["--sim-time-scale", "20", "--sim-startup-seconds", "0.1"],
                    "log_dir": str(tmp_path / "logs"),
                    "stop_grace_s": 5,
                },
                {"name": "theirs", "model": EXTERNAL_MODEL, "kind": "external", "urls": [url]},
            ],
            "pacing": {"queue_band": [2, 8], "headroom": 2, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
            "proxy": {"gpu_sample_interval_s": 0},
            "batch": {"dir": str(tmp_path / "batches")},
        },
        "<fleet>",
    )
    pool = build_pool(policy, policy.placement(None))
    assert isinstance(pool, Fleet)
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        await wait_until(
            lambda: len(pool.workers()) == 3 and all(w.state is WorkerState.READY for w in pool.workers()),
            "three workers ready",
            timeout=30,
        )
        yield f"http://127.0.0.1:{port}", app[PROXY], fake
    finally:
        await runner.cleanup()
        await fake.stop()
    assert all(w.state is WorkerState.STOPPED for w in pool.workers() if w.managed)


async def test_managed_and_external_pools_side_by_side(proxy: tuple[str, ProxyState, FakeEngine]) -> None:
    url, st, fake = proxy
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
        doc: dict[str, Any] = await r.json()
    rows = {w["id"]: w for w in doc["workers"]}
    assert set(rows) == {"local-w0", "local-w1", "theirs-w0"}
    assert (rows["local-w0"]["gpus"], rows["local-w1"]["gpus"]) == ([2, 3], [0, 1])  # tp ids per worker, in order
    assert rows["local-w0"]["args"]["tp_size"] == 2 and rows["local-w0"]["pid"] and rows["local-w0"]["managed"]
    assert rows["theirs-w0"] | {"pool": "theirs", "model": EXTERNAL_MODEL, "gpus": [], "pid": None} == rows["theirs-w0"]
    assert not rows["theirs-w0"]["managed"] and rows["theirs-w0"]["url"] == fake.url
    assert set(doc["pool_queues"]) == {"local", "theirs"}

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    async with client:
        assert sorted(m.id for m in (await client.models.list()).data) == sorted([SIM_MODEL, EXTERNAL_MODEL])
        before = len(fake.bodies)
        for model in (SIM_MODEL, EXTERNAL_MODEL, SIM_MODEL):
            r = await client.completions.create(model=model, prompt="hi", max_tokens=2)
            assert r.choices[0].text
        assert len(fake.bodies) == before + 1  # only the external pool's request reached the external server

    # each pool its own controller; the external pool's cannot restart its worker (advice only)
    assert set(st.controllers) == {"local", "theirs"}
    assert st.controllers["theirs"].actor.pool.workers()[0].id == "theirs-w0"  # type: ignore[attr-defined]
    view = PoolView(st.pool, "local")
    assert [w.id for w in view.workers()] == ["local-w0", "local-w1"]
