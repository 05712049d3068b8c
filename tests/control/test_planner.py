"""The planner's twin on workloads run through the simulator with hidden factors: calibration from the
worker's own decode statistics, predictions, candidates and the restart economics."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from proxy.control.planner import (
    DecodeStats,
    Observed,
    PlanSettings,
    RestartCost,
    Twin,
    calibrate,
    candidates,
    plan,
)
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate

GPU, MODEL = "a100-40gb", "llama-3.1-8b"


def _workload(n: int, rate: float, out: tuple[int, int], max_tokens: int, seed: int = 3) -> list[Observed]:
    rng = random.Random(seed)
    t, found = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        found.append(Observed(arrived=t, prompt_tokens=rng.randint(200, 800), output_tokens=rng.randint(*out),
                              max_tokens=max_tokens))  # fmt: skip
    return found


def _live(workload: list[Observed], args: dict, *, step: float, time_scale: float):
    """The 'worker': the simulator with a hidden step-time factor, at a time scale (arrivals scaled)."""
    cfg = Twin(GPU, MODEL).config({**args, "sim_time_scale": time_scale})
    cfg = replace(cfg, step_time_factor=step, time_scale=time_scale)
    specs = [RequestSpec(arrival=o.arrived, prompt_len=o.prompt_tokens, max_new_tokens=o.max_tokens,
                         output_len=o.output_tokens) for o in workload]  # fmt: skip
    res = simulate(cfg, specs)
    stats = [DecodeStats(running=r, used_tokens=u, gen_throughput=g, cuda_graph=c) for r, u, g, c in res.decode_stats]
    return cfg, res, stats


@pytest.mark.parametrize(("hidden", "time_scale"), [(1.0, 1.0), (1.25, 1.0), (0.8, 10.0)])
def test_the_twin_calibrates_to_a_hidden_step_time_and_predicts_throughput_within_5_percent(hidden, time_scale):
    wl = _workload(300, 3.0 * time_scale, (100, 1800), 2000)
    cfg, res, stats = _live(wl, {}, step=hidden, time_scale=time_scale)
    twin = calibrate(GPU, MODEL, {}, stats, cfg.max_total_num_tokens, wl)
    assert twin.step_time_factor == pytest.approx(hidden / time_scale, rel=0.05)
    predicted = twin.predict({}, wl)
    assert predicted.output_tok_per_s == pytest.approx(res.output_tok_per_s, rel=0.05)


def test_a_smaller_kv_pool_than_the_presets_give_is_matched():
    twin = calibrate(GPU, MODEL, {}, [], 50_000)
    assert twin.kv_factor < 1 and twin.config({}).max_total_num_tokens == pytest.approx(50_000, rel=0.01)
    assert twin.step_time_factor == 1.0  # nothing to calibrate the step time on


def test_candidates_are_bounded_and_stay_inside_the_bounds():
    s = PlanSettings(max_candidates=6)
    found = candidates({"schedule_conservativeness": 0.3}, {"max_running_requests": 256.0}, s)
    assert len(found) == 6
    assert all(0.1 <= c["schedule_conservativeness"] <= 2.0 for c in found)
    assert {"schedule_conservativeness": 0.3} not in found
    many = candidates({}, {"max_running_requests": 256, "chunked_prefill_size": 4096, "mem_fraction_static": 0.85},
                      PlanSettings(max_candidates=50))  # fmt: skip
    assert {"max_running_requests": 128} in many and {"chunked_prefill_size": 8192} in many
    assert {"mem_fraction_static": 0.87} in many


def test_a_backlog_of_short_answers_under_a_large_max_tokens_plans_a_restart_that_pays():
    # outputs far below max_tokens, backlogged: conservativeness 1.0 reserves room they never use
    wl = _workload(300, 1000.0, (120, 500), 4096)
    twin = Twin(GPU, MODEL)
    p = plan(twin, {"schedule_conservativeness": 1.0}, wl, RestartCost(startup_s=30.0), PlanSettings())
    assert p.best.args["schedule_conservativeness"] < 1.0 and p.predicted_gain > 0.1
    assert p.worth and p.gain_tokens > p.cost_tokens and "predicted gain" in p.reason
    assert p.replays <= 1 + PlanSettings().max_candidates
    # the same gain over a horizon too short for it does not pay the restart
    short = plan(twin, {"schedule_conservativeness": 1.0}, wl, RestartCost(startup_s=30.0), PlanSettings(horizon_s=5.0))
    assert not short.worth and "does not pay" in short.reason
    # and moving back is not blocked by any guard: long outputs near max_tokens from a low value
    long = _workload(300, 1000.0, (1500, 2000), 2000)
    back = plan(twin, {"schedule_conservativeness": 0.1}, long, RestartCost(startup_s=30.0), PlanSettings())
    assert back.best.args["schedule_conservativeness"] > 0.1


def test_arrival_bound_chat_predicts_no_gain_and_no_restart():
    wl = _workload(200, 2.0, (20, 200), 4096)
    p = plan(Twin(GPU, MODEL), {}, wl, RestartCost(startup_s=30.0), PlanSettings())
    assert not p.worth and abs(p.predicted_gain) < 0.03


def test_candidates_that_leave_too_little_free_memory_are_refused():
    wl = _workload(50, 5.0, (50, 100), 200)
    p = plan(Twin(GPU, MODEL), {"mem_fraction_static": 0.85}, wl, RestartCost(startup_s=1.0),
             PlanSettings(min_available_gb=5.0, memory_fraction_step=0.05))  # fmt: skip
    assert [r.args.get("mem_fraction_static") for r in p.refused] == [0.9]  # 3.4 GB free: below the floor
    assert p.best.args.get("mem_fraction_static") != 0.9


def test_restart_cost_in_tokens():
    assert RestartCost(startup_s=30, drain_s=10, recomputed_tokens=5000).tokens(1000.0) == 45_000


def test_the_twin_is_judged_on_the_requests_it_replayed():
    from proxy.control.planner import measured_throughput

    wl = _workload(100, 2.0, (100, 300), 1000)
    res = simulate(Twin(GPU, MODEL).config({}), [RequestSpec(arrival=o.arrived, prompt_len=o.prompt_tokens,
                   max_new_tokens=o.max_tokens, output_len=o.output_tokens) for o in wl])  # fmt: skip
    done = [replace(o, finished=r.finish_time) for o, r in zip(wl, res.requests, strict=True)]
    assert measured_throughput(wl) is None  # no answer times
    first = min(o.arrived for o in wl)
    assert measured_throughput(done) == pytest.approx(res.output_tokens / (res.makespan_s - first), rel=1e-6)
    p = plan(Twin(GPU, MODEL), {}, done, RestartCost(startup_s=10.0), PlanSettings(max_candidates=1))
    assert p.current_error is not None and p.current_error < 0.02  # the same engine: the twin is right
