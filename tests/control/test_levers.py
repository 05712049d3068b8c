"""The tuning guide's schedule policy and CUDA-graph batch size as planner candidates, priced by the twin.

The worker's answers come from the simulator in virtual time (the twin's own presets: no calibration in
the way), with the prefix key and cached tokens the proxy records per request; the plans are the
planner's own, on the newest 300 answers.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import replace

import pytest

from loadtests.oracle import sim_config
from loadtests.scenario_defs import SCENARIOS, Workload
from proxy.control.candidates import graphs_follow_cap, lever_candidates
from proxy.control.planner import Observed, PlanSettings, RestartCost, Twin, plan, replay
from proxy.control.workload import shared_heads
from proxy.server.validation import AFFINITY_CHARS
from proxy.sim.virtual import simulate


def _answered(workload: Workload, args: Mapping[str, object], gpu: str, model: str) -> list[Observed]:
    """What a worker under ``args`` answered of ``workload`` (a backlog), as the proxy records it."""
    res = simulate(sim_config(args, gpu=gpu, model=model), workload.specs())
    out = []
    for r, (text, max_tokens, _) in zip(res.requests, workload.requests(), strict=True):
        assert r.finish_time is not None
        out.append(Observed(arrived=r.arrival, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                            max_tokens=max_tokens, finished=r.finish_time, cached_tokens=r.cached_tokens,
                            prefix_key=zlib.crc32(text[:AFFINITY_CHARS].encode())))  # fmt: skip
    return out


def _gain(p_gains: Mapping[str, float], arg: str, value: object) -> float:
    key = next(k for k in p_gains if f"{arg}={value!r}" in k.split(","))
    return p_gains[key]


# a backlog behind the proxy's gate as the shipped policy sets it for an lpm worker (its engine's prefix limit,
# inside the queue band 100 and headroom 32)
BACKLOG = PlanSettings(horizon_s=600.0, backlog=True, engine_queue=128, gate_period_s=0.5)


def test_the_replay_carries_the_heads_a_group_shares_and_none_where_prompts_are_unique() -> None:
    shared = replace(SCENARIOS["prefix-shared"].workload, count=200)
    seen = _answered(shared, {"schedule_policy": "lpm"}, "a100-40gb", "llama-3.1-8b")
    heads = shared_heads(seen)
    assert 30 <= len(heads) <= 48 and set(heads.values()) <= set(range(2990, 3011))  # the 3,000-token heads
    assert any(sp.shared for sp in replay(seen).specs)
    unique = replace(SCENARIOS["prefix-none"].workload, count=100)
    alone = _answered(unique, {"schedule_policy": "lpm"}, "h200-141gb", "llama-3.2-1b")
    assert shared_heads(alone) == {} and not any(sp.shared for sp in replay(alone).specs)


def test_with_heavy_prefix_sharing_the_twin_keeps_lpm() -> None:
    """prefix-shared's first 600 requests at lpm: fcfs, the one policy candidate, loses in the twin."""
    sc = SCENARIOS["prefix-shared"]
    seen = _answered(replace(sc.workload, count=600), sc.start_args, sc.gpu, sc.model)
    p = plan(Twin(sc.gpu, sc.model), sc.start_args, seen, RestartCost(startup_s=30.0), BACKLOG)
    assert _gain(p.gains, "schedule_policy", "fcfs") < -BACKLOG.min_gain
    assert p.best.args.get("schedule_policy") == "lpm"


def test_with_no_prefix_shared_the_twin_finds_fcfs_pays() -> None:
    """prefix-none's first 600 requests at lpm on a 1B model and an H200: fcfs gains past the
    planner's noise floor (the lpm rounds' matching costs a fast decode step), and from fcfs lpm is
    not even a candidate (the replay has no prefix sharing for it to work on)."""
    sc = SCENARIOS["prefix-none"]
    seen = _answered(replace(sc.workload, count=600), sc.start_args, sc.gpu, sc.model)
    twin = Twin(sc.gpu, sc.model)
    p = plan(twin, sc.start_args, seen, RestartCost(startup_s=15.0), BACKLOG)
    assert _gain(p.gains, "schedule_policy", "fcfs") > BACKLOG.min_gain
    fcfs = {**sc.start_args, "schedule_policy": "fcfs"}
    assert not any(c.get("schedule_policy") == "lpm" for c in lever_candidates(twin, fcfs, replay(seen), 100))


def test_a_batch_past_the_cuda_graphs_plans_graphs_that_cover_it() -> None:
    """graph-outgrown's first 1,500 requests: the batch (~970) runs past SGLang's default graphs (256 on
    an H200 at tp 1); the candidate is the ladder's rung that covers it, and it gains."""
    sc = SCENARIOS["graph-outgrown"]
    seen = _answered(replace(sc.workload, count=1500), sc.start_args, sc.gpu, sc.model)
    twin = Twin(sc.gpu, sc.model)
    p = plan(twin, sc.start_args, seen, RestartCost(startup_s=30.0), BACKLOG)
    assert p.current.peak_running > 768
    assert _gain(p.gains, "cuda_graph_max_bs_decode", 1024) > BACKLOG.min_gain


def test_without_the_engines_cached_tokens_the_policy_is_not_weighed() -> None:
    """A worker that does not report its cached tokens (SGLang without --enable-cache-report): the replay
    cannot tell shared prompts from unique ones, so neither policy is proposed."""
    sc = SCENARIOS["prefix-shared"]
    seen = [replace(o, cached_tokens=None) for o in _answered(replace(sc.workload, count=100), sc.start_args,
                                                               sc.gpu, sc.model)]  # fmt: skip
    p = plan(Twin(sc.gpu, sc.model), sc.start_args, seen, RestartCost(startup_s=30.0), BACKLOG)
    assert not any("schedule_policy='fcfs'" in key for key in p.gains)


@pytest.mark.parametrize(("peak", "want"), [(100, []), (300, [384]), (700, [768]), (5000, [1024])])
def test_graph_candidates_cover_the_batch_seen_and_never_go_down(peak: int, want: list[int]) -> None:
    twin = Twin("h100-80gb", "llama-3.1-8b")  # default graphs: 256
    got = [c["cuda_graph_max_bs_decode"] for c in lever_candidates(twin, {}, replay([]), peak)
           if "cuda_graph_max_bs_decode" in c]  # fmt: skip
    assert got == want


def test_the_policys_bounds_hold_the_graphs() -> None:
    twin = Twin("h100-80gb", "llama-3.1-8b")
    bounded = lever_candidates(twin, {}, replay([]), 700, graph_bounds=(1, 512))
    assert [c["cuda_graph_max_bs_decode"] for c in bounded] == [512]
    assert lever_candidates(twin, {}, replay([]), 700, graph_bounds=(256, 256)) == []


def test_graphs_sized_to_the_running_cap_follow_it_when_the_cap_is_raised() -> None:
    """fleet's w3 (running cap 64, its graphs sized to it before its launch) on a backlog: the candidate
    that raises the cap re-derives the graphs for the new cap, and gains more than the cap alone would.
    Graphs that are not the cap's (SGLang's own default here) stay where they are."""
    sc = SCENARIOS["fleet"]
    args = {"schedule_conservativeness": 0.3, "max_running_requests": 64, "cuda_graph_max_bs_decode": 64}
    twin = Twin(sc.gpu, sc.model)
    settings = replace(BACKLOG, horizon_s=600.0)
    raised = graphs_follow_cap(twin, args, {**args, "max_running_requests": 128}, settings)
    assert raised["cuda_graph_max_bs_decode"] == 128
    assert graphs_follow_cap(twin, args, {**args, "max_running_requests": 32}, settings) == {
        **args,
        "max_running_requests": 32,
    }
    default = {"schedule_conservativeness": 0.3, "max_running_requests": 64}  # SGLang's 32 for this GPU
    assert "cuda_graph_max_bs_decode" not in graphs_follow_cap(
        twin, default, {**default, "max_running_requests": 128}, settings
    )
    seen = _answered(replace(sc.workload, count=600, rate=None), args, sc.gpu, sc.model)
    p = plan(twin, args, seen, RestartCost(startup_s=30.0), settings)
    assert p.best.args["max_running_requests"] == 128 and p.best.args["cuda_graph_max_bs_decode"] == 128
    alone = twin.predict({**args, "max_running_requests": 128}, replay(seen))
    assert p.best.output_tok_per_s > alone.output_tok_per_s
