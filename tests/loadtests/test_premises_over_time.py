"""The five premises with arrivals over time: their definitions (an hour of Poisson or bursty arrivals,
decode-oom a quarter hour; judged on the time from arrival to answer), and the oracle scoring that figure in its
paced replay (requests fed as they arrive, each answer timed from its arrival)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest

from loadtests.oracle import Pacing, SearchSpace, evaluate, paired_args, sim_config, simulate_paced, sweep
from loadtests.scenario_defs import SCENARIOS, Workload
from loadtests.scenarios import ArmResult, _replay_score, scenario_pacing
from proxy.request.pacing import Band
from proxy.sim.request import RequestSpec

PREMISES = ("early-stop", "retraction-storm", "prefill-oom", "decode-oom", "low-mem-fraction")
HORIZON_S = {"decode-oom": 900.0}  # modelled seconds of arrivals; the others an hour
PACING = Pacing(band=Band(lo=100, hi=400, headroom=32), scrape_s=5.0)


@pytest.mark.parametrize("premise", PREMISES)
def test_each_premise_arrives_over_an_hour_poisson_and_bursty(premise: str) -> None:
    poisson, bursty = SCENARIOS[f"{premise}-poisson"], SCENARIOS[f"{premise}-bursty"]
    batch = SCENARIOS[premise]
    for sc, shape in ((poisson, 1.0), (bursty, 0.3)):
        wl = sc.workload
        assert isinstance(wl, Workload) and wl.rate is not None and wl.shape == shape
        # a backlog's premise is judged on throughput, one that keeps up on waiting
        assert sc.judged_on == ("throughput" if premise == "retraction-storm" else "answer_time")
        assert sc.gpu == batch.gpu and sc.model == batch.model
        # decode-oom over time starts at fraction 0.95, where its batch dies before the pool fills (below)
        assert sc.start_args == (
            {**batch.start_args, "mem_fraction_static": 0.95} if premise == "decode-oom" else batch.start_args
        )
        horizon = HORIZON_S.get(premise, 3600.0)
        arrivals = wl.arrivals()
        assert arrivals == sorted(arrivals) and 0.95 * horizon < arrivals[-1] <= horizon  # the horizon's arrivals
        longer = dataclasses.replace(wl, count=wl.count + 1).arrivals()
        assert longer[:-1] == arrivals and longer[-1] > horizon  # every arrival within the horizon, none after
        assert wl.count == pytest.approx(wl.rate * horizon, rel=0.15)
    # the same mean rate; bursty: gaps with squared coefficient of variation near 1 / 0.3
    gaps = {}
    for sc in (poisson, bursty):
        a = sc.workload.arrivals()
        gaps[sc.name] = [y - x for x, y in itertools.pairwise(a)]
    cv2 = {n: statistics.pvariance(g) / statistics.mean(g) ** 2 for n, g in gaps.items()}
    assert 0.8 < cv2[poisson.name] < 1.2
    assert 2.5 < cv2[bursty.name] < 4.5
    assert statistics.mean(gaps[bursty.name]) == pytest.approx(statistics.mean(gaps[poisson.name]), rel=0.2)


def test_the_paced_replay_feeds_requests_as_they_arrive() -> None:
    """Two requests a minute apart: the second is not sent before it arrives, and each answer is timed from
    its own arrival (a replay that sent both at 0 would answer the second long before it exists)."""
    cfg = sim_config({}, gpu="a100-40gb", model="llama-3.1-8b")
    wl = [
        RequestSpec(prompt_len=200, max_new_tokens=100, output_len=100, arrival=0.0),
        RequestSpec(prompt_len=200, max_new_tokens=100, output_len=100, arrival=60.0),
    ]
    res = simulate_paced(cfg, wl, PACING)
    assert res.finished == 2 and res.oom is None
    assert res.makespan_s > 60.0  # the second arrived at 60 s
    assert 0.5 < res.mean_answer_s < 10.0  # 100 tokens each, served as they came: seconds, not a minute
    together = simulate_paced(cfg, [RequestSpec(prompt_len=200, max_new_tokens=100, output_len=100)] * 2, PACING)
    assert together.makespan_s < 10.0


def test_the_oracle_scores_answer_time_where_throughput_cannot_tell() -> None:
    """Arrivals that both arguments keep up with: the same tokens per second, different waits. Scored
    on throughput the two tie; on answer time the sweep picks the one that answers sooner."""
    wl = Workload(count=120, prompt_len=(100, 300), max_tokens=4000, output_len=(200, 400), seed=3, rate=3.0).specs()
    tight = {"max_total_tokens": 30000}
    cautious = evaluate({**tight, "schedule_conservativeness": 1.0}, wl, gpu="a100-40gb", model="llama-3.1-8b",
                        pacing=PACING, objective="answer_time")  # fmt: skip
    bold = evaluate({**tight, "schedule_conservativeness": 0.1}, wl, gpu="a100-40gb", model="llama-3.1-8b",
                    pacing=PACING, objective="answer_time")  # fmt: skip
    assert bold.output_tok_per_s == pytest.approx(cautious.output_tok_per_s, rel=0.01)  # throughput cannot tell
    assert bold.mean_answer_s < 0.9 * cautious.mean_answer_s
    assert bold.score == pytest.approx(1.0 / bold.mean_answer_s) and bold.score > cautious.score
    space = SearchSpace(schedule_conservativeness=(0.1, 1.0), chunked_prefill_size=(None,), max_running_requests=(None,),
                        mem_fraction_static=(None,), passes=1, pacing=PACING, objective="answer_time")  # fmt: skip
    result = sweep({**tight, "schedule_conservativeness": 1.0}, wl, gpu="a100-40gb", model="llama-3.1-8b", space=space)
    assert result.best.args["schedule_conservativeness"] == 0.1
    assert result.best.objective == "answer_time" and result.best.as_dict()["mean_answer_s"] > 0
    # a crash scores nothing on either figure: one long prompt at a time fills the 16384 chunk
    dead = evaluate({"chunked_prefill_size": 16384, "mem_fraction_static": 0.9},
                    Workload(count=5, prompt_len=(18000, 20000), max_tokens=64, output_len=(16, 64), rate=0.1).specs(),
                    gpu="l40s-48gb", model="llama-3.1-8b", pacing=PACING, objective="answer_time")  # fmt: skip
    assert dead.oom == "prefill" and dead.score == 0.0


def test_a_replay_and_an_arm_are_scored_on_the_scenario_figure() -> None:
    waits, backlog = SCENARIOS["early-stop-poisson"], SCENARIOS["retraction-storm-poisson"]
    head = Workload(count=30, prompt_len=(200, 600), max_tokens=2000, output_len=(1200, 2000), seed=42, rate=1.05)
    res = simulate_paced(sim_config({}, gpu=waits.gpu, model=waits.model), head.specs(), scenario_pacing(waits))
    assert _replay_score(waits, res) == pytest.approx(1.0 / res.mean_answer_s)
    assert _replay_score(backlog, res) == res.output_tok_per_s
    arm = ArmResult(arm="adaptive", args={}, control_mode="auto", time_scale=waits.time_scale, output_tok_per_s=900.0,
                    requests_ok=2, latencies={0: 1.0, 1: 3.0})  # fmt: skip
    assert arm.mean_answer_s == pytest.approx(2.0 * waits.time_scale)  # wall seconds -> modelled
    assert arm.judged("answer_time") == pytest.approx(1.0 / (2.0 * waits.time_scale))
    assert arm.judged("throughput") == 900.0
    arm.requests_failed = 1  # an arm that did not answer everyone is not judged on the answers it gave
    assert arm.judged("answer_time") == 0.0


def test_decode_oom_over_time_dies_at_its_start_arguments_and_not_at_the_cap_that_fits() -> None:
    """The first 6,000 Poisson arrivals (the paced replay's death comes at ~4,900): the running cap 2048
    at fraction 0.95 grows the decode batch past the ~560 the free memory holds; the cap the start-up
    line's free memory allows (563) serves the same arrivals."""
    sc = SCENARIOS["decode-oom-poisson"]
    head = sc.workload.specs()[:6000]
    pacing = scenario_pacing(sc)
    died = simulate_paced(sim_config(sc.start_args, gpu=sc.gpu, model=sc.model), head, pacing)
    assert died.oom == "decode" and 540 < died.peak_running < 600
    capped = {**sc.start_args, "max_running_requests": 563}
    served = simulate_paced(sim_config(capped, gpu=sc.gpu, model=sc.model), head, pacing)
    assert served.oom is None and served.finished == len(head)


def test_the_sweep_pairs_each_running_cap_with_the_fractions_nearest_the_best() -> None:
    """decode-oom over time from fraction 0.95: the caps that fit its free memory (384) gain alone, and
    at cap 384 a smaller fraction gains nothing; the cap of 768 at 0.93 gains only both at once. The
    paired step tries every cap at the three fractions nearest the best's."""
    space = SearchSpace(max_running_requests=(None, 384, 768), mem_fraction_static=(None, 0.6, 0.89, 0.91, 0.93))
    best = {"max_running_requests": 384, "mem_fraction_static": 0.95, "schedule_conservativeness": 0.3}
    tried = paired_args(best, space, 0.95)
    assert [(a["mem_fraction_static"], a["max_running_requests"]) for a in tried] == [
        (f, cap) for f in (0.93, 0.91, 0.89) for cap in (None, 384, 768)
    ]
    assert all(a["schedule_conservativeness"] == 0.3 for a in tried)
    # SGLang's own fraction (unset): the fractions nearest the one it resolves to
    assert sorted({a["mem_fraction_static"] for a in paired_args({}, space, 0.9)}) == [0.89, 0.91, 0.93]
    assert sorted({a["mem_fraction_static"] for a in paired_args({}, space, 0.7)}) == [0.6, 0.89, 0.91]


def test_a_decode_batch_near_the_free_memory_in_the_replay_is_not_a_candidate() -> None:
    """decode-oom's batch at fraction 0.91 and conservativeness 0.3: in the paced replay its first fill
    peaks at ~0.9 of the free memory with no step over it, and live it died. A decode batch over 0.8 of
    the free memory is a knife edge: the sweep does not take it."""
    sc = SCENARIOS["decode-oom"]
    head = sc.workload.specs()[:4000]
    kw = {"gpu": sc.gpu, "model": sc.model, "pacing": scenario_pacing(sc)}
    edge = {"mem_fraction_static": 0.91, "schedule_conservativeness": 0.3}
    res = simulate_paced(sim_config(edge, gpu=sc.gpu, model=sc.model), head, scenario_pacing(sc))
    assert res.oom is None and 0.8 < res.peak_decode_fraction <= res.peak_activation_fraction < 0.9
    assert evaluate(edge, head, max_activation_fraction=0.9, **kw).unsafe is False
    assert evaluate(edge, head, max_activation_fraction=0.9, max_decode_fraction=0.8, **kw).unsafe is True
    assert SearchSpace().max_decode_fraction == 0.8
