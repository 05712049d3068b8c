"""Ray actors outlive the proxy: a real ``pacer serve`` on the Ray backend (a local Ray cluster: a
head and one raylet with two logical GPUs) in front of simulated engines, killed outright.

- a second proxy started while the first lives takes none of its actors;
- SIGKILLed and started again, it re-attaches its detached actors: the same actors and engine pids,
  the first request answered by the same server (its own start time unchanged), and a clean stop
  after that still ends them;
- SIGKILLed and never started again, its actors stop their engines and end within their lease;
- ``engine.keep_on_exit``: a clean stop leaves the actors running; a proxy started with another
  command for them stops them and starts new ones.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.workers.supervisor import free_port, port_is_free
from tests.harness.wait import wait_until
from tests.workers.test_adopt_e2e import alive, ask, get_json, ready_workers, serving, started_at, until

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from proxy.workers.ray_backend import actor_name  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's"),
]
WORKERS = ("chat-w0", "chat-w1")

POLICY = """
[fleet]
backend = "ray"
ray_address = "{address}"
ray_namespace = "{namespace}"
node_loss_check_s = 0.2

[proxy]
gpu_sample_interval_s = 0

[control]
mode = "off"

[[pool]]
name = "chat"
model = "chat-model"
kind = "sim"
tp = 1
workers = 2
gpus = "auto"
base_port = {base_port}
stop_grace_s = 2
keep_on_exit = {keep}
extra_args = ["--sim-time-scale", "20", "--sim-startup-seconds", "0.1"]

[pool.args]
max_running_requests = {running}
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # fast health checks (as tests/workers/test_ray_backend.py); no dashboard, no autoscaler
    health = {"health_check_period_ms": 200, "health_check_failure_threshold": 5}
    head = {"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "no_monitor": True, "_system_config": health}
    c = Cluster(initialize_head=True, head_node_args=head)
    c.add_node(num_cpus=1, num_gpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="pacer-test-detached", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()  # type: ignore[no-untyped-call]


class Deployment:
    """One deployment's folder, its own Ray namespace and its workers' ports."""

    def __init__(self, folder: Path, address: str) -> None:
        self.folder, self.address = folder, address
        self.namespace = f"pacer-test-{uuid.uuid4().hex[:8]}"
        self.base_port = _two_free_ports()

    def write(self, *, keep: bool = False, running: int = 64) -> None:
        text = POLICY.format(
            address=self.address,
            namespace=self.namespace,
            base_port=self.base_port,
            keep=str(keep).lower(),
            running=running,
        )
        (self.folder / "policy.toml").write_text(text)

    def actor(self, worker_id: str) -> Any:
        """The worker's actor; None: there is none."""
        try:
            return ray.get_actor(actor_name(worker_id), namespace=self.namespace)
        except ValueError:
            return None

    def actor_ids(self) -> dict[str, str | None]:
        return {wid: (a._actor_id.hex() if (a := self.actor(wid)) is not None else None) for wid in WORKERS}

    def log(self, worker_id: str) -> str:
        return (self.folder / ".pacer" / "logs" / f"{worker_id}.log").read_text()


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port("127.0.0.1")
        if port < 65535 and port_is_free("127.0.0.1", port + 1):
            return port
    raise OSError("no two free ports in a row")


def _gpus_free() -> bool:
    return bool(ray.available_resources().get("GPU", 0) == ray.cluster_resources().get("GPU", -1))


@pytest.fixture
async def deployment(cluster: Cluster, tmp_path: Path) -> Any:
    """A deployment on the cluster; every actor it left is gone (and its GPUs free) when the test ends."""
    d = Deployment(tmp_path, cluster.address)
    yield d
    for wid in WORKERS:
        if (a := d.actor(wid)) is not None:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
    await wait_until(_gpus_free, "the cluster's GPUs free", timeout=60)


async def down_workers(serve: Any) -> dict[str, dict[str, Any]] | None:
    ws = {w["id"]: w for w in (await get_json(serve.url + "/admin/workers"))["workers"]}
    return ws if len(ws) == len(WORKERS) and all(w["state"] == "down" for w in ws.values()) else None


def actors_gone(d: Deployment) -> bool:
    return not any(d.actor_ids().values()) and _gpus_free()


async def test_a_killed_proxy_restarted_reattaches_its_detached_actors_and_a_clean_stop_ends_them(
    deployment: Deployment,
) -> None:
    d = deployment
    d.write()
    with serving(d.folder, lease_s=30.0) as first:
        before = await ready_workers(first)
        starts = {wid: await started_at(w) for wid, w in before.items()}
        actors = d.actor_ids()
        assert all(actors.values()) and len(set(actors.values())) == 2
        with serving(d.folder, lease_s=30.0) as rival:  # a second proxy while the first lives takes nothing
            refused = await until(lambda: down_workers(rival), "the second proxy's workers refused")
            assert all("held" in (w["last_error"] or "") for w in refused.values()), refused
            assert rival.stop() == 0
        assert d.actor_ids() == actors
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert all(alive(w["pid"]) for w in before.values()), "an engine died with the proxy"
    assert d.actor_ids() == actors, "an actor died with the proxy's driver"

    with serving(d.folder, lease_s=30.0) as second:
        after = await ready_workers(second)
        assert {wid: w["pid"] for wid, w in after.items()} == {wid: w["pid"] for wid, w in before.items()}
        assert {wid: w["url"] for wid, w in after.items()} == {wid: w["url"] for wid, w in before.items()}
        assert d.actor_ids() == actors
        assert await ask(second.url)
        assert {wid: await started_at(w) for wid, w in after.items()} == starts  # no reload
        for wid in WORKERS:
            text = d.log(wid)
            assert text.count("pacer: start: worker") == 1 and "pacer: re-attached: worker" in text, text
        assert second.stop() == 0
    for w in after.values():
        assert not alive(w["pid"]), "a clean stop left an engine running"
    await wait_until(lambda: actors_gone(d), "the actors ended by the clean stop", timeout=30)


async def test_actors_whose_proxy_never_comes_back_stop_within_their_lease(deployment: Deployment) -> None:
    d = deployment
    d.write()
    lease_s = 2.0
    with serving(d.folder, lease_s=lease_s) as serve:
        workers = await ready_workers(serve)
        serve.stop(signal.SIGKILL)
        killed = time.monotonic()
    pids = [w["pid"] for w in workers.values()]
    assert all(alive(pid) for pid in pids) and all(d.actor_ids().values())

    def all_gone() -> bool:
        return not any(alive(pid) for pid in pids) and actors_gone(d)

    # the lease, the check interval, the grace (2 s): a minute in production, seconds here; the bound
    # leaves a starved CPU 10 s over them (as tests/workers/test_adopt_e2e.py)
    await wait_until(all_gone, "the actors to stop on their own", timeout=lease_s + 2.0 + 30.0, every=0.1)
    assert time.monotonic() - killed < lease_s + 2.0 + 10.0
    for w in workers.values():
        assert port_is_free("127.0.0.1", int(w["url"].rsplit(":", 1)[1]))


async def test_keep_on_exit_leaves_the_actors_and_a_changed_command_replaces_them(deployment: Deployment) -> None:
    d = deployment
    d.write(keep=True, running=64)
    with serving(d.folder, lease_s=30.0) as first:
        before = await ready_workers(first)
        actors = d.actor_ids()
        assert first.stop() == 0
    assert all(alive(w["pid"]) for w in before.values()), "keep_on_exit: an engine stopped with the proxy"
    assert d.actor_ids() == actors

    d.write(keep=False, running=32)
    with serving(d.folder, lease_s=30.0) as second:
        after = await ready_workers(second)
        for wid, w in after.items():
            assert w["pid"] != before[wid]["pid"] and w["args"]["max_running_requests"] == 32
            assert (await get_json(w["url"] + "/server_info"))["max_running_requests"] == 32
            assert not alive(before[wid]["pid"])
            assert "not re-attached (stopped): its command changed" in d.log(wid)
        renewed = d.actor_ids()
        assert all(renewed.values()) and not set(renewed.values()) & set(actors.values())
        assert await ask(second.url)
        assert second.stop() == 0
    await wait_until(lambda: actors_gone(d), "the actors ended by the clean stop", timeout=30)
