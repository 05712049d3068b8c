"""A worker against its pool: the peers' arguments, at the least gain their rates allow (pure figures
in, candidate out; the planner's use of it in the plan's verdict, the controller's in its looks)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.control.peers import PeerLoad, peer_candidate
from proxy.control.planner import Observed, PlanSettings, RestartCost, Twin, plan, run_plan
from proxy.control.planning import planned
from proxy.policy import ControlMode

from .test_controller import RecordingActor, controller, info
from .test_planner_controller import ARGS, Requests, _backlog_of_short_answers, _scrapes

HW = ("a100-40gb", "llama-3.1-8b")
TUNED = {"schedule_conservativeness", "max_running_requests", "cuda_graph_max_bs_decode", "mem_fraction_static"}
PEERS_ARGS = {"schedule_conservativeness": 0.3, "cuda_graph_max_bs_decode": 160}
CAPPED = {"schedule_conservativeness": 0.3, "max_running_requests": 64, "cuda_graph_max_bs_decode": 64}


def _load(
    wid: str, args: Mapping[str, object], rate: float | None, busy: float = 1.0, hardware: tuple[str, str] = HW
) -> PeerLoad:
    return PeerLoad(worker_id=wid, args=args, hardware=hardware, rate=rate, busy=busy)


def _pool() -> tuple[PeerLoad, list[PeerLoad]]:
    mine = _load("w3", CAPPED, 7500.0)
    return mine, [_load("w0", PEERS_ARGS, 10900.0), _load("w1", PEERS_ARGS, 11050.0), _load("w2", PEERS_ARGS, 11470.0)]


def test_a_worker_trailing_its_peers_gets_their_arguments_at_the_gain_measured_on_them() -> None:
    own, others = _pool()
    found = peer_candidate(own, others, TUNED)
    assert found is not None and dict(found.args) == PEERS_ARGS and found.peers == ("w0", "w1", "w2")
    assert found.gain == pytest.approx((10900 + 11050 + 11470) / 3 / 7500 - 1)
    assert 0 < found.spread < 0.03
    # the peers themselves are not offered the trailing worker's arguments
    assert peer_candidate(others[0], [own, *others[1:]], TUNED) is None


def test_the_gain_is_the_least_the_rates_allow_its_own_idle_time_taken_off() -> None:
    own, others = _pool()
    full = peer_candidate(own, others, TUNED)
    # idle a tenth of its window, its capacity may be a ninth above its rate: the gain is that much less
    tenth = peer_candidate(_load("w3", CAPPED, 7500.0, busy=0.9), others, TUNED)
    assert full is not None and tenth is not None and tenth.gain == pytest.approx(0.9 * (full.gain + 1) - 1)
    # idle most of the time, it serves what it is sent: no gain read from rates
    assert peer_candidate(_load("w3", CAPPED, 7500.0, busy=0.6), others, TUNED) is None
    assert peer_candidate(_load("w3", CAPPED, None), others, TUNED) is None  # not measured
    # a peer that idles only serves less than it could: the gain read is lower, never higher
    idle_peer = [*others[:2], _load("w2", PEERS_ARGS, 9000.0, busy=0.8)]
    low = peer_candidate(own, idle_peer, TUNED)
    assert low is not None and full is not None and 0 < low.gain < full.gain
    spread_out = [*others[:2], _load("w2", PEERS_ARGS, 5000.0, busy=0.5)]  # the peers disagree by more than it gains
    assert peer_candidate(own, spread_out, TUNED) is None


def test_peers_on_other_hardware_or_placement_are_not_peers() -> None:
    own, _ = _pool()
    other_gpu = [_load("w0", PEERS_ARGS, 11000.0, hardware=("h100", "llama-3.1-8b"))]
    other_tp = [_load("w0", {**PEERS_ARGS, "tp_size": 2}, 11000.0)]
    assert peer_candidate(own, other_gpu, TUNED) is None
    assert peer_candidate(own, other_tp, TUNED) is None
    same_args = [_load("w0", CAPPED, 11000.0)]  # ahead on the same arguments: nothing to move to
    assert peer_candidate(own, same_args, TUNED) is None


def test_a_lead_inside_the_peers_own_spread_is_noise_and_the_best_group_is_offered() -> None:
    own = _load("w3", CAPPED, 10000.0)
    scattered = [_load("w0", PEERS_ARGS, 9000.0), _load("w1", PEERS_ARGS, 12500.0)]  # mean 10750: +7.5 %, spread 23 %
    assert peer_candidate(own, scattered, TUNED) is None
    slow = {**PEERS_ARGS, "schedule_conservativeness": 1.0}
    two = [_load("w0", PEERS_ARGS, 12000.0), _load("w1", slow, 11000.0), _load("w2", slow, 11100.0)]
    found = peer_candidate(own, two, TUNED)
    assert found is not None and dict(found.args) == PEERS_ARGS and found.gain == pytest.approx(0.2)


def _fed_at_its_pace(n: int = 300) -> list[Observed]:
    """What the gate sent a worker capped at 64 running: about as fast as it answered (each request
    sent as one ended), so its own traffic shows no capacity to gain."""
    rng = random.Random(5)
    t, found = 0.0, []
    for _ in range(n):
        t += rng.expovariate(2.0)
        out = rng.randint(300, 1000)
        found.append(Observed(arrived=t, prompt_tokens=rng.randint(300, 900), output_tokens=out, max_tokens=1536,
                              finished=t + 6.0))  # fmt: skip
    return found


def test_the_plan_weighs_the_peers_arguments_at_the_measured_gain_and_says_so() -> None:
    twin, wl, cost = Twin(*HW), _fed_at_its_pace(), RestartCost(startup_s=20.0)
    alone = plan(twin, CAPPED, wl, cost, PlanSettings())
    assert not alone.worth and alone.predicted_gain < 0.03  # its own traffic: no capacity to gain
    own, others = _pool()
    peer = peer_candidate(own, others, TUNED)
    assert peer is not None
    p = plan(twin, CAPPED, wl, cost, PlanSettings(peer=peer))
    assert p.worth and dict(p.best.args) == PEERS_ARGS  # the peers' arguments as they run them: no larger pool
    assert p.predicted_gain == pytest.approx(peer.gain)
    assert "max_running_requests 64 -> unset" in p.reason and "the gain measured on w0, w1, w2" in p.reason
    # the same gain over a horizon too short for it does not pay the restart, as any candidate's
    short = plan(twin, CAPPED, wl, cost, PlanSettings(peer=peer, horizon_s=2.0))
    assert not short.worth and "does not pay" in short.reason


def test_the_controller_offers_a_worker_the_arguments_of_the_peers_that_serve_more_beside_it(tmp_path: Path) -> None:
    capped = {**ARGS, "max_running_requests": 64}
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor(), around=Requests(_backlog_of_short_answers()))
    c.track(info("w0", args=capped))
    c.track(info("w1", args=ARGS))
    seconds = int(c.constants.window_s) + 1  # work waiting for each throughout a window
    _scrapes(c, clock, "w0", 0.0, seconds, 64, 7000.0)
    _scrapes(c, clock, "w1", 0.0, seconds, 150, 10500.0)
    jobs = {job.worker_id: job for job in c.plans_due()}
    peer = jobs["w0"].inputs.settings.peer
    assert peer is not None and dict(peer.args) == ARGS and peer.peers == ("w1",)
    assert peer.gain == pytest.approx(0.5, rel=0.02)
    assert jobs["w1"].inputs.settings.peer is None  # the one ahead is not offered the other's
    plan = run_plan(jobs["w0"].inputs)
    assert plan.peer is not None and plan.peer.peers == ("w1",)
    evidence = planned(jobs["w0"], plan).to_json()
    assert evidence["peers_rate"] == pytest.approx(10500.0, rel=0.02) and evidence["busy"] == 1.0
