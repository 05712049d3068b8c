"""The Ray backend on a real local Ray cluster (``ray.cluster_utils.Cluster``: a head and three
raylets with two logical GPUs each on this machine) running simulated engines.

Workers are placed by Ray's GPU accounting on distinct GPUs across nodes (each engine process has
Ray's CUDA_VISIBLE_DEVICES), a rolling restart through the proxy loses no request, and the
workers of a node that dies are revived on another node by the controller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.compose import build_app, serve
from proxy.policy import Policy, parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.fleet import Fleet, build_pool
from proxy.workers.supervisor import Supervisor
from tests.harness.wait import wait_until

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from proxy.workers.ray_backend import RayLauncher  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
GPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # the GCS checks each raylet every 0.2 s and calls a node dead after 5 failed checks in a row (Ray's
    # defaults: 3 s and 5): a removed node's GPUs leave the cluster's resources in a second, not in 15
    health = {"health_check_period_ms": 200, "health_check_failure_threshold": 5}
    # no autoscaler (its monitor process): the cluster's nodes are the test's own
    head = {"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "no_monitor": True, "_system_config": health}
    c = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(3):
        c.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="pacer-test", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def fleet_policy(tmp_path: Path, pools: list[dict[str, Any]], **top: Any) -> Policy:
    for p in pools:
        p.setdefault("kind", "sim")
        p.setdefault("gpus", "auto")
        p.setdefault("extra_args", ["--sim-time-scale", "20", "--sim-startup-seconds", "0.1"])
        p.setdefault("log_dir", str(tmp_path / "logs"))
        p.setdefault("stop_grace_s", 5)
    return parse_policy(
        {
            "fleet": {"backend": "ray", "node_loss_check_s": 0.2},
            "pool": pools,
            "proxy": {"gpu_sample_interval_s": 0},
            "pacing": {"queue_band": [2, 8], "headroom": 2, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
            "batch": {"dir": str(tmp_path / "batches")},
            **top,
        },
        "<ray>",
    )


def visible_devices(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


@pytest.fixture
async def proxy(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[ProxyState]:
    policy: Policy = request.param(tmp_path)
    async with RayLauncher(cluster.address, "pacer-test", poll_s=0.2) as launcher:
        pool = build_pool(policy, {}, launcher)
        app = build_app(policy, pool)
        runner, port = await serve(app, "127.0.0.1", 0)
        st = app[PROXY]
        st.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        try:
            n = sum(p.engine.workers for p in policy.pools)
            await wait_until(
                lambda: len(pool.workers()) == n and all(w.state is WorkerState.READY for w in pool.workers()),
                "workers ready",
                timeout=60,
            )
            yield st
        finally:
            await runner.cleanup()
        assert all(w.state is WorkerState.STOPPED for w in pool.workers())
    # every actor is gone with the workers: the GPUs are free again
    await wait_until(
        lambda: ray.available_resources().get("GPU", 0) == ray.cluster_resources().get("GPU", -1),
        "GPUs released",
        timeout=60,
    )


def two_pools(tmp_path: Path) -> Policy:
    return fleet_policy(
        tmp_path,
        [
            {"name": "big", "model": "big-model", "tp": 2, "workers": 2},
            {"name": "small", "model": "small-model", "tp": 1, "workers": 2},
        ],
    )


@pytest.mark.parametrize("proxy", [two_pools], indirect=True)
async def test_placement_on_distinct_gpus_across_nodes_and_routing(proxy: ProxyState) -> None:
    st = proxy
    assert isinstance(st.pool, Fleet)
    workers = {w.id: w for w in st.pool.workers()}
    taken = [(w.node, g) for w in workers.values() for g in w.gpus]
    assert len(taken) == 6 == len(set(taken))  # every GPU of the cluster, each once
    for w in workers.values():
        assert w.node is not None and w.pid is not None
        assert len(w.gpus) == (2 if w.pool == "big" else 1)
        assert visible_devices(w.pid) == ",".join(map(str, w.gpus))  # Ray's accounting, in the engine's env
    assert workers["big-w0"].node != workers["big-w1"].node  # a tp-2 worker takes a whole 2-GPU node
    assert workers["big-w0"].args["tp_size"] == 2

    client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=30)  # type: ignore[attr-defined]
    async with client:
        for model in ("big-model", "small-model"):
            r = await client.completions.create(model=model, prompt="hi", max_tokens=3)
            assert r.choices[0].text
    # log lines came back: the proxy pulls them from the actor every poll, apart from the health check
    # that made the worker ready, so the start-up line may arrive a poll after the worker serves
    await wait_until(
        lambda: any("The server is fired up and ready to roll!" in line for line in st.pool.tail("small-w1", 200)),
        "the worker's start-up line pulled from its actor",
        timeout=30.0,
    )


def one_pool_auto(tmp_path: Path) -> Policy:
    return fleet_policy(
        tmp_path,
        [{"name": "chat", "model": "chat-model", "tp": 2, "workers": 2}],
        # advise: a lost worker is revived as it was (its clock 20 x the wall's: the crash back-off
        # 0.1 s), and nothing else restarts a worker while the test rolls them (in auto the start-up
        # line after the roll's restart has the memory fraction raised)
        control={"mode": "advise", "journal_path": str(tmp_path / "decisions.jsonl")},
    )


@pytest.mark.parametrize("proxy", [one_pool_auto], indirect=True)
async def test_rolling_restart_loses_nothing_and_a_dead_node_is_revived_elsewhere(
    proxy: ProxyState, cluster: Cluster
) -> None:
    st = proxy
    assert isinstance(st.pool, Supervisor)
    client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60)  # type: ignore[attr-defined]
    stop = asyncio.Event()
    answers: list[str] = []
    errors: list[BaseException] = []

    async def load() -> None:
        while not stop.is_set():
            try:
                r = await client.completions.create(model="chat-model", prompt="tell me", max_tokens=8)
                answers.append(r.choices[0].text)
            except Exception as exc:  # counted, not raised: the assertion below names them
                errors.append(exc)

    rollout = st.controllers["chat"].actor
    before = {w.id: w for w in st.pool.workers()}
    async with client:
        tasks = [asyncio.create_task(load()) for _ in range(6)]
        try:
            await wait_until(lambda: len(answers) >= 6, "answers before the roll")
            for wid in before:  # a rolling restart: one worker at a time, new args, new actor
                result = await rollout.restart(wid, {**before[wid].args, "max_running_requests": 24}, "test roll")
                assert result.info.state is WorkerState.READY, result
            rolled = len(answers)
            await wait_until(lambda: len(answers) >= rolled + 6, "answers after the roll")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert not errors, errors[:3]
    assert len(answers) > 20
    journal = st.journal.entries() if st.journal is not None else []
    after = {w.id: w for w in st.pool.workers()}
    for wid, w in after.items():  # the roll's restart only: the controller did not act on the roll's dip
        assert w.state is WorkerState.READY and w.args["max_running_requests"] == 24 and w.restarts == 1, (
            w,
            journal,
        )
        assert w.pid != before[wid].pid

    # a node dies: its worker's actor is lost, the controller revives it where GPUs are free
    victim = after["chat-w0"]
    node = next(
        n for n in cluster.worker_nodes if victim.node and n.node_ip_address in victim.node and _hosts(n, victim)
    )
    cluster.remove_node(node, allow_graceful=False)
    await wait_until(
        lambda: st.pool.get("chat-w0").restarts == 2 and st.pool.get("chat-w0").state is WorkerState.READY,
        "revived",
        timeout=90,
    )
    revived = st.pool.get("chat-w0")
    assert revived.node != victim.node and len(revived.gpus) == 2
    other = st.pool.get("chat-w1")  # the other worker, on a node that lives: untouched
    journal = st.journal.entries() if st.journal is not None else []
    assert other.state is WorkerState.READY, (other, journal)
    assert (other.pid, other.restarts, other.node) == (after["chat-w1"].pid, 1, after["chat-w1"].node), (
        other,
        journal,
    )
    decisions = st.journal.entries(worker="chat-w0") if st.journal is not None else []
    assert any(d["action"] == "restart" and d["status"] != "failed" for d in decisions), decisions


def _hosts(node: Any, worker: Any) -> bool:
    return bool(worker.node) and f"({str(node.node_id)[:12]})" in worker.node
