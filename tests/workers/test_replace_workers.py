"""A reshape's step in the pool (``replace_workers``): workers stopped, others started on their GPUs,
through a Fleet's pool view as the controller's rollout reaches it. Real ``pacer sim`` processes."""

from __future__ import annotations

from pathlib import Path

from proxy.policy import parse_policy
from proxy.workers.base import WorkerInfo, WorkerState
from proxy.workers.fleet import Fleet, PoolView, build_pool
from proxy.workers.lease import lease_path
from tests.harness.wait import wait_until
from tests.workers.conftest import alive


def _pool(tmp_path: Path, name: str, gpus: list[int]) -> dict[str, object]:
    return {"name": name, "model": f"m-{name}", "kind": "sim", "tp": 2, "gpus": gpus,
            "extra_args": ["--sim-model", "llama-3.2-1b", "--sim-startup-seconds", "0.1"],
            "log_dir": str(tmp_path / name), "stop_grace_s": 5}  # fmt: skip


async def test_a_pool_view_replaces_workers_on_their_gpus(tmp_path: Path) -> None:
    policy = parse_policy({"pool": [_pool(tmp_path, "local", [2, 3, 0, 1]), _pool(tmp_path, "other", [4, 5])]})
    fleet = build_pool(policy, policy.placement(None))
    assert isinstance(fleet, Fleet)
    told: list[WorkerInfo] = []
    fleet.add_listener(told.append)
    view = PoolView(fleet, "local")
    await fleet.start()
    try:
        assert [(w.id, w.gpus) for w in view.workers()] == [("local-w0", (2, 3)), ("local-w1", (0, 1))]
        old = fleet.get("local-w1")
        one = {**old.args, "tp_size": 1}
        infos = await view.replace_workers(["local-w1"], 2, one, "test: tp 2 into two tp 1")
        # the lowest free ids: its own, then one past the pool's; its GPUs split in order
        assert [(i.id, i.gpus, i.state, i.args["tp_size"]) for i in infos] == [
            ("local-w1", (0,), WorkerState.READY, 1),
            ("local-w2", (1,), WorkerState.READY, 1),
        ]
        assert old.pid is not None and infos[0].pid != old.pid
        pid = old.pid
        await wait_until(lambda: not alive(pid), "the old process is gone")
        assert ("local-w1", WorkerState.STOPPED) in [(i.id, i.state) for i in told]
        assert sorted(w.id for w in view.workers()) == ["local-w0", "local-w1", "local-w2"]
        assert len({w.url for w in fleet.workers()}) == 4  # every worker on its own port
        assert fleet.get("local-w2").pool == "local" and [w.id for w in PoolView(fleet, "other").workers()] == [
            "other-w0"
        ]
        # and back: two tp-1 workers into one tp-2 on their GPUs; the id left over is gone, its lease too
        (back,) = await view.replace_workers(["local-w1", "local-w2"], 1, old.args, "test: back")
        assert (back.id, back.gpus, back.state, back.args["tp_size"]) == ("local-w1", (0, 1), WorkerState.READY, 2)
        assert sorted(w.id for w in view.workers()) == ["local-w0", "local-w1"]
        assert not lease_path(tmp_path / "local" / "local-w2.log").exists()
        assert fleet.get("local-w0").state is WorkerState.READY  # the other group served throughout
    finally:
        await fleet.stop()
    assert all(w.state is WorkerState.STOPPED for w in fleet.workers())
