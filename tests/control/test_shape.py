"""Data against tensor parallelism: a pool's GPUs priced in each shape (workers x tp) by the twin, in
virtual time, and the controller's look at its pool's shape (recorded inputs, a clock the test moves).

The issue's target, in virtual time: a pool of 8 simulated H100s serving an 8B model as one tp-8
worker. The advice names the better shape and its predicted gain; an oracle replays a backlog of the
same traffic (other requests of the same mix) on every shape, every replica, and the shape the advice
names serves at least 0.95 x the best in hindsight, its gain near the one predicted."""

from __future__ import annotations

import asyncio
import random

import pytest

from proxy.control.decision import Decision, RuleKind
from proxy.control.journal import Status
from proxy.control.ports import Act, Drain
from proxy.control.reshaping import fresh_args, run_shapes
from proxy.control.shape import Shape, compare_shapes, shape_args, shapes_for
from proxy.control.twin import Twin
from proxy.control.workload import Observed
from proxy.engines.base import Sample
from proxy.engines.sglang.engine import SIM
from proxy.policy import ControlMode, PolicyError, parse_policy
from proxy.sim.request import RequestSpec
from proxy.sim.twin import TWIN_ENGINE
from proxy.sim.virtual import simulate
from proxy.workers.base import WorkerInfo, WorkerState

from .test_controller import Around, controller

TP_ARGS = {tp: TWIN_ENGINE.placement_args(tp, None) for tp in (1, 2, 4, 8)}
H100_8B = Twin("h100-80gb", "llama-3.1-8b")


def _mix(seed: int, n: int) -> list[tuple[int, int]]:
    """Chat-like requests: (prompt, output) tokens."""
    rng = random.Random(seed)
    return [(rng.randint(200, 2000), rng.randint(50, 600)) for _ in range(n)]


def _recent(seed: int = 1, n: int = 512) -> list[Observed]:
    """What the pool's facts hold: its newest answered requests (512: one worker's ring)."""
    return [Observed(arrived=i * 0.01, prompt_tokens=p, output_tokens=o, max_tokens=1024, finished=i * 0.01 + 5)
            for i, (p, o) in enumerate(_mix(seed, n))]  # fmt: skip


def _hindsight(twin: Twin, backlog: list[tuple[int, int]]) -> dict[Shape, float]:
    """Every shape of 8 GPUs serving ``backlog`` (waiting at once, dealt to the replicas in turn), every
    replica replayed: the output over the last replica's end."""
    out: dict[Shape, float] = {}
    for shape in shapes_for(8):
        cfg = twin.config(TP_ARGS[shape.tp])
        tokens, span = 0, 0.0
        for r in range(shape.workers):
            specs = [RequestSpec(arrival=0.0, prompt_len=p, max_new_tokens=1024, output_len=o)
                     for p, o in backlog[r :: shape.workers]]  # fmt: skip
            res = simulate(cfg, specs)
            tokens, span = tokens + res.output_tokens, max(span, res.makespan_s)
        out[shape] = tokens / span
    return out


def test_the_shapes_of_a_pool() -> None:
    assert [str(s) for s in shapes_for(8)] == ["8 x tp 1", "4 x tp 2", "2 x tp 4", "1 x tp 8"]
    assert shapes_for(6) == [Shape(1, 6), Shape(2, 3)] and shapes_for(1) == [Shape(1, 1)]


def test_an_8b_pool_at_tp8_is_advised_the_shape_that_serves_the_most_in_hindsight() -> None:
    comparison = compare_shapes(H100_8B, {}, _recent(), Shape(8, 1), TP_ARGS)
    assert comparison is not None and comparison.current.shape == Shape(8, 1)
    assert str(comparison.best.shape) == "8 x tp 1" and comparison.gain > 0.3
    assert all(r.unfit is None for r in comparison.results)
    kv = {r.shape.tp: r.kv_tokens for r in comparison.results}
    assert kv[8] > 8 * kv[1]  # the weights split over 8 GPUs leave more for the KV pool than 8 copies do
    # the oracle: 6,000 other requests of the same mix waiting on the pool (a backlog long enough that the
    # fill and the drain of the largest shape's batch weigh little against its steady pace)
    truth = _hindsight(H100_8B, _mix(2, 6000))
    best = max(truth.values())
    assert truth[comparison.best.shape] >= 0.95 * best
    measured_gain = truth[comparison.best.shape] / truth[Shape(8, 1)] - 1.0
    assert abs(comparison.gain - measured_gain) <= 0.2 * measured_gain
    predicted = {r.shape: r.output_tok_per_s for r in comparison.results}
    assert sorted(truth, key=truth.__getitem__) == sorted(predicted, key=predicted.__getitem__)  # same order


def test_a_70b_fits_only_at_tp4_and_tp8() -> None:
    twin = Twin("h100-80gb", "llama-3.1-70b")
    comparison = compare_shapes(twin, {}, _recent(n=200), Shape(4, 2), TP_ARGS)
    assert comparison is not None
    unfit = {r.shape.tp: r.unfit for r in comparison.results}
    assert unfit[1] is not None and "does not start" in unfit[1]
    assert unfit[2] is not None and unfit[4] is None and unfit[8] is None
    assert comparison.best.shape.tp in (4, 8) and comparison.best.output_tok_per_s > 0


def test_tensor_parallel_costs_each_step_more_as_tp_grows() -> None:
    steps = {tp: H100_8B.config(TP_ARGS[tp]).step_model() for tp in (1, 2, 4, 8)}
    assert steps[1].tp_comm_seconds(256, 256) == 0.0
    comm = [steps[tp].tp_comm_seconds(256, 256) for tp in (2, 4, 8)]
    assert 0 < comm[0] < comm[1] < comm[2]
    # a small batch: tp 8 reads an eighth of the weights per GPU and is quicker per step ...
    assert steps[8].decode_seconds(8, 8000, True) < steps[1].decode_seconds(8, 8000, True)
    # ... a large one: eight tp-1 replicas at an eighth of the batch each write more per GPU
    one = 128 / steps[1].decode_seconds(128, 128 * 1500, True)
    eight = 1024 / steps[8].decode_seconds(1024, 1024 * 1500, True) / 8
    assert one > 1.2 * eight
    pcie = Twin("l40s-48gb", "llama-3.1-8b").config(TP_ARGS[2]).step_model()
    nvlink = Twin("h100-80gb", "llama-3.1-8b").config(TP_ARGS[2]).step_model()
    assert pcie.tp_comm_seconds(256, 256) > 5 * nvlink.tp_comm_seconds(256, 256)  # no NVLink: PCIe


# -- the controller's look at its pool's shape -------------------------------------------------------

POOL_ARGS = {"sim_gpu": "h100-80gb", "sim_model": "llama-3.1-8b", "tp_size": 8, "served_model_name": "m"}


class PoolRequests(Around):
    def __init__(self, requests: list[Observed], backlog: int) -> None:
        super().__init__(backlog=backlog)
        self.requests = requests

    def recent_requests(self, worker_id: str) -> list[Observed]:
        return self.requests

    def in_flight(self, worker_id: str) -> list[object]:
        return []


def _pool_controller(mode: ControlMode, backlog: int, **kw: object):
    c, clock = controller(mode, None, around=PoolRequests(_recent(), backlog), plan_interval_s=60.0,
                          min_evidence_s=20.0, restarts_per_hour=0, **kw)  # fmt: skip
    c._reshaping._placement = lambda tp: SIM.placement_args(tp, "m")  # as the app builds it for a [[pool]]
    c.track(WorkerInfo(id="p-w0", url="http://127.0.0.1:1", state=WorkerState.READY, managed=True,
                       args=dict(POOL_ARGS), pid=1, pool="p", gpus=tuple(range(8))))  # fmt: skip
    for k in range(31):  # half a minute of scrapes at 20,000 tokens a second
        clock.now = float(k)
        c.on_sample("p-w0", Sample(time=clock.now, queue=50 if backlog else 0, running=900, token_usage=0.6,
                                   generation_tokens_total=20_000.0 * k))  # fmt: skip
    return c, clock


def _look(c, clock, at: float):
    clock.now = at
    job = c.shapes_due()
    assert job is not None
    return c.decide_shape(job, run_shapes(job.inputs))


def test_advise_journals_each_shape_the_better_one_and_its_gain() -> None:
    c, clock = _pool_controller(ControlMode.ADVISE, backlog=400)
    assert _look(c, clock, 30.0) is None
    (entry,) = [e for e in c.journal.entries() if e["rule"] == "reshape"]
    assert entry["status"] == "advised" and entry["detail"] == "control.mode = advise"
    assert entry["current_shape"] == "1 x tp 8" and entry["best_shape"] == "8 x tp 1"
    assert entry["predicted_gain"] > 0.3 and entry["evidence"]["work_waits"] is True
    assert [s["shape"] for s in entry["shapes"]] == ["8 x tp 1", "4 x tp 2", "2 x tp 4", "1 x tp 8"]
    assert all(s["predicted_throughput"] > 0 for s in entry["shapes"])
    assert entry["reason"].startswith("8 x tp 1 would serve +")
    assert c.shapes_due() is None  # the next look a plan interval later
    clock.now = 89.0
    assert c.shapes_due() is None
    clock.now = 91.0
    assert c.shapes_due() is not None


def test_auto_reshapes_only_where_the_pool_allows_it_and_work_waits() -> None:
    c, clock = _pool_controller(ControlMode.AUTO, backlog=400)  # reshape = false, the default
    assert _look(c, clock, 30.0) is None
    (entry,) = [e for e in c.journal.entries() if e["rule"] == "reshape"]
    assert entry["status"] == "advised" and entry["detail"] == "the pool's control.reshape is false"
    assert not c._reshaping.pending  # advised only: the worker's own plans go on

    c, clock = _pool_controller(ControlMode.AUTO, backlog=0, reshape=True)  # nothing waits: nothing gained now
    assert _look(c, clock, 30.0) is None
    (entry,) = [e for e in c.journal.entries() if e["rule"] == "reshape"]
    assert entry["status"] == "noted" and "no work waits for the pool" in entry["reason"]

    c, clock = _pool_controller(ControlMode.AUTO, backlog=400, reshape=True)
    assert not c._reshaping.pending
    assert _look(c, clock, 30.0) is None  # one look is chance: plan_confirmations looks in a row
    assert c._reshaping.pending  # a worker's own plan waits for the next look: the reshape replaces it
    act = _look(c, clock, 91.0)
    assert act is not None and act.decision.rule == "reshape"
    assert act.decision.new_args == {**POOL_ARGS, "tp_size": 1}
    assert c._reshaping.under_way and c.plans_due() == []  # no plan of a worker while the pool is reshaped
    assert [e["status"] for e in c.journal.entries() if e["rule"] == "reshape"][-1] == "acting"


def _policy(control: dict[str, object], **pool: object) -> None:
    parse_policy({"pool": [{"name": "p", "model": "m", "kind": "sim", "tp": 8, "gpus": list(range(8)),
                            "control": control, **pool}]})  # fmt: skip


def test_check_policy_validates_reshape() -> None:
    _policy({"reshape": True})
    with pytest.raises(PolicyError, match="expected"):
        _policy({"reshape": "yes"})
    with pytest.raises(PolicyError, match=r"pool\.p\.control\.reshape.*base_port"):
        _policy({"reshape": True}, base_port=31000)
    with pytest.raises(PolicyError, match=r"control\.reshape.*\[engine\] table"):
        parse_policy({"engine": {"kind": "sim", "workers": 2}, "control": {"reshape": True}})
    with pytest.raises(PolicyError, match="needs the pool's gpus"):
        parse_policy({"pool": [{"name": "p", "model": "m", "kind": "sim", "tp": 2, "workers": 2,
                                "control": {"reshape": True}}]})  # fmt: skip
    with pytest.raises(PolicyError, match="worker_args name workers a reshape replaces"):
        _policy({"reshape": True}, worker_args=[{"schedule_conservativeness": 0.5}])
    with pytest.raises(PolicyError, match="twin does not model"):
        parse_policy({"pool": [{"name": "p", "model": "m", "kind": "vllm", "tp": 2, "gpus": [0, 1],
                                "control": {"reshape": True}}]})  # fmt: skip


# -- the rollout, group by group, its first group the canary --------------------------------------------

TP2 = {**POOL_ARGS, "tp_size": 2}
TP1 = {**POOL_ARGS, "tp_size": 1}


class Reshaper:
    """The pool's side of a reshape, as the supervisor does it: new workers on the old ones' GPUs, with
    the lowest free ids."""

    def __init__(self) -> None:
        self.gpus: dict[str, tuple[int, ...]] = {"p-w0": (0, 1), "p-w1": (2, 3)}
        self.calls: list[tuple[list[str], int, int]] = []

    def gpus_of(self, worker_id: str) -> tuple[int, ...]:
        return self.gpus[worker_id]

    async def reshape_step(self, old, count, args, reason):  # type: ignore[no-untyped-def]
        self.calls.append((list(old), count, int(args["tp_size"])))
        freed = [g for wid in old for g in self.gpus.pop(wid)]
        each, infos = len(freed) // count, []
        for j in range(count):
            wid = next(f"p-w{i}" for i in range(8) if f"p-w{i}" not in self.gpus)
            self.gpus[wid] = tuple(freed[j * each : (j + 1) * each])
            infos.append(WorkerInfo(id=wid, url="http://127.0.0.1:1", state=WorkerState.READY, managed=True,
                                    args=dict(args), pid=2, pool="p", gpus=self.gpus[wid]))  # fmt: skip
        return infos, [Drain(in_flight_at_drain=3, drained=True, drain_s=0.5) for _ in old]


async def _serve_per_gpu(c, clock, rates: dict[int, float], stop: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
    """Each worker writes ``rates[its tp]`` tokens a second per GPU, scraped every second of loop time."""
    loop, tokens = asyncio.get_running_loop(), {}
    while not stop.is_set():
        clock.now = 100.0 + loop.time()
        for wid in list(c._workers):
            tp = int(c.state(wid).args["tp_size"])
            tokens[wid] = tokens.get(wid, 0.0) + rates[tp] * tp
            c.on_sample(wid, Sample(time=clock.now, queue=5, running=50, token_usage=0.5,
                                    generation_tokens_total=tokens[wid]))  # fmt: skip
        await asyncio.sleep(1.0)


@pytest.mark.looptime
@pytest.mark.parametrize(("tp1_per_gpu", "promoted"), [(3000.0, True), (1500.0, False)], ids=["promoted", "reverted"])
async def test_a_reshape_rolls_out_group_by_group_behind_a_canary(tp1_per_gpu: float, promoted: bool) -> None:
    c, clock = controller(ControlMode.AUTO, None, reshape=True, interval_s=1.0, min_evidence_s=5.0, window_s=10.0)
    for wid, gpus in (("p-w0", (0, 1)), ("p-w1", (2, 3))):
        c.track(WorkerInfo(id=wid, url="http://127.0.0.1:1", state=WorkerState.READY, managed=True, args=dict(TP2),
                           pid=1, pool="p", gpus=gpus))  # fmt: skip
    decision = Decision(worker_id="p-w0", rule="reshape", reason="4 x tp 1 would serve more", time=0.0,
                        old_args=TP2, new_args=TP1, kind=RuleKind.TUNING)  # fmt: skip
    act = Act(decision=decision, entry_id=c.journal.record(decision, mode=ControlMode.AUTO, status=Status.ACTING))
    stop, reshaper = asyncio.Event(), Reshaper()
    serving = asyncio.create_task(_serve_per_gpu(c, clock, {1: tp1_per_gpu, 2: 2000.0}, stop))
    c._reshaping.under_way = True
    await c._reshaping.carry_out(act, reshaper)
    stop.set()
    await serving
    entry = c.journal.get(act.entry_id)
    assert entry is not None and not c._reshaping.under_way
    canary = entry["act"]["steps"][0]["canary"]
    assert canary["old_per_gpu"] == pytest.approx(2000.0, rel=0.05)
    assert canary["per_gpu"] == pytest.approx(tp1_per_gpu, rel=0.05) and canary["promoted"] is promoted
    tps = {wid: c.state(wid).args["tp_size"] for wid in c._workers}
    if promoted:  # the second group after the canary: four tp-1 workers, one GPU each
        assert entry["status"] == "applied" and entry["detail"] == "the pool is 4 x tp 1"
        assert reshaper.calls == [(["p-w0"], 2, 1), (["p-w1"], 2, 1)]
        assert tps == {"p-w0": 1, "p-w1": 1, "p-w2": 1, "p-w3": 1}
        assert sorted(reshaper.gpus.values()) == [(0,), (1,), (2,), (3,)]
    else:  # the canary's GPUs back to the old shape; the other group never touched
        assert entry["status"] == "failed" and "canary" in entry["detail"]
        assert reshaper.calls == [(["p-w0"], 2, 1), (["p-w0", "p-w2"], 1, 2)]
        assert tps == {"p-w0": 2, "p-w1": 2} and reshaper.gpus == {"p-w0": (0, 1), "p-w1": (2, 3)}
    assert [s["drains"][0]["in_flight_at_drain"] for s in entry["act"]["steps"]] == [3] * len(reshaper.calls)


def test_another_shape_starts_from_the_policys_memory_fraction() -> None:
    tuned = {**POOL_ARGS, "mem_fraction_static": 0.913, "max_running_requests": 768}
    assert fresh_args(tuned, POOL_ARGS, "mem_fraction_static") == {**POOL_ARGS, "max_running_requests": 768}
    given = {**POOL_ARGS, "mem_fraction_static": 0.85}
    assert fresh_args(tuned, given, "mem_fraction_static")["mem_fraction_static"] == 0.85
    # a running cap set for a tp-8 worker's eight GPUs: an eighth of it per tp-1 worker
    assert shape_args(tuned, 8, 1, {"tp_size": 1})["max_running_requests"] == 96
