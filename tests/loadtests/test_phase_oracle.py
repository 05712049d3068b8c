"""The per-phase oracle of a shift (loadtests.phase_oracle): each phase's best arguments among the
sweep's trials, scored on that phase inside the trial's replay, and the adaptive arm judged against it."""

from __future__ import annotations

import math

import pytest

from loadtests.oracle import Pacing, SearchSpace, Trial, sim_config, simulate_paced, sweep
from loadtests.phase_oracle import adaptive_over_phase_oracle, phase_oracle, phase_scores, switchable
from loadtests.scenario_defs import SCENARIOS, Phases, Workload
from proxy.request.pacing import Band

# chat arriving at 1 per second for 2 s (requests 0, 1), then a batch of two at 10 s (requests 2, 3)
TWO = Phases(parts=(
    Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), rate=1.0, seed=1),
    Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), start_s=10.0, seed=2),
))  # fmt: skip


def _trial(args: dict[str, float], answer_s: tuple[float, ...], score: float = 1.0) -> Trial:
    return Trial(args=args, output_tok_per_s=score, answer_s=answer_s)


def test_a_shift_can_be_switched_between_and_a_mix_cannot() -> None:
    assert switchable(SCENARIOS["shift"].workload) and switchable(SCENARIOS["shift-perturbed"].workload)
    assert not switchable(SCENARIOS["mixed"].workload)  # its phases arrive together, the chat streamed
    assert switchable(TWO)


def test_each_phase_takes_the_trial_that_scores_it_best() -> None:
    """Three trials on a hand-timed sweep: the best single arguments (a) are second best in each phase;
    b is best on the chat, c on the batch; c never answered one chat request, so it is no chat candidate."""
    a = _trial({"schedule_conservativeness": 0.3}, (2.0, 2.0, 4.0, 4.0))  # chat mean 2 s; batch 20 tok / 4 s
    b = _trial({"schedule_conservativeness": 0.1}, (1.0, 1.0, 8.0, 8.0))  # chat mean 1 s; batch 20 tok / 8 s
    c = _trial({"schedule_conservativeness": 1.0}, (1.0, math.nan, 2.0, 2.0))  # batch 20 tok / 2 s
    unsafe = Trial(args={"mem_fraction_static": 0.95}, output_tok_per_s=0.0, unsafe=True, answer_s=(0.1,) * 4)
    assert phase_scores(TWO, a.answer_s) == [0.5, 5.0]
    assert phase_scores(TWO, c.answer_s) == [0.0, 10.0]
    oracle = phase_oracle(TWO, [a, b, c, unsafe], a)
    assert oracle is not None and oracle["candidates"] == 3  # the unsafe trial is none
    chat, batch = oracle["phases"]
    assert (chat["best_args"], chat["gain"], chat["judged_on"]) == (
        {"schedule_conservativeness": 0.1},
        2.0,
        "answer_time",
    )
    assert (batch["best_args"], batch["gain"], batch["judged_on"]) == (
        {"schedule_conservativeness": 1.0},
        2.0,
        "throughput",
    )
    assert oracle["replay_gain"] == 2.0
    # b's chat was answered within 1 s of arrivals at ~1-2 s; c's batch by 12 s with nothing after it
    assert chat["alone"] and batch["alone"]
    late = _trial({"schedule_conservativeness": 0.1}, (20.0, 20.0, 8.0, 8.0))  # its chat ran into the batch
    worst = phase_oracle(TWO, [a, late], a)
    assert worst is not None and worst["phases"][0]["gain"] == 1.0 and worst["phases"][0]["alone"]  # a wins the chat
    assert phase_oracle(TWO, [late], late)["phases"][0]["alone"] is False  # type: ignore[index]
    assert phase_oracle(SCENARIOS["mixed"].workload, [a], a) is None  # type: ignore[arg-type]
    assert phase_oracle(TWO, [a], _trial({}, ())) is None  # a sweep without answer times


def test_the_adaptive_arm_is_judged_against_the_live_oracle_scaled_by_each_phase_gain() -> None:
    oracle = {"phases": [{"judged_on": "answer_time", "gain": 1.25}, {"judged_on": "throughput", "gain": 1.1}]}
    rows = [
        {"judged_on": "queue time", "adaptive": {"mean_s": 8.0}, "oracle": {"mean_s": 10.0}},
        {"judged_on": "throughput", "adaptive": {"tok_per_s": 1100.0}, "oracle": {"tok_per_s": 1000.0}},
    ]
    judged = adaptive_over_phase_oracle(rows, oracle)
    # chat: 10 / 8 = 1.25 over the static, / 1.25 = 1.0; batch: 1.1 / 1.1 = 1.0
    assert judged == {"ratio": 1.0, "phase_ratios": [1.0, 1.0]}
    rows[0]["adaptive"] = {"mean_s": 10.0}  # level with the best single arguments on the chat: 0.8 of its oracle
    assert adaptive_over_phase_oracle(rows, oracle) == {"ratio": round(0.8**0.5, 4), "phase_ratios": [0.8, 1.0]}
    assert adaptive_over_phase_oracle(rows, None) is None
    assert adaptive_over_phase_oracle([{"judged_on": "throughput", "adaptive": {"tok_per_s": 1.0}}] * 2, oracle) is None


def test_on_a_real_sweep_a_phase_scored_inside_the_trace_is_that_phase_replayed_alone() -> None:
    """A tiny shift swept in virtual time: every phase's gain is at least 1, and where its best arguments'
    replay had the phase alone, the phase replayed by itself under them scores the same."""
    phases = Phases(parts=(
        Workload(count=40, prompt_len=(100, 300), max_tokens=4096, output_len=(50, 150), rate=2.0, seed=21),
        Workload(count=60, prompt_len=(100, 300), max_tokens=800, output_len=(600, 800), start_s=60.0, seed=22),
        Workload(count=40, prompt_len=(100, 300), max_tokens=4096, output_len=(50, 150), rate=2.0, seed=23,
                 start_s=400.0),
    ))  # fmt: skip
    pacing = Pacing(band=Band(lo=20, hi=80, headroom=8), scrape_s=2.0)
    space = SearchSpace(schedule_conservativeness=(0.1, 0.3, 1.0), chunked_prefill_size=(None,),
                        max_running_requests=(None,), mem_fraction_static=(None,), passes=1, pacing=pacing)  # fmt: skip
    start = {"schedule_conservativeness": 0.3, "max_total_tokens": 20000}
    result = sweep(start, phases.specs(), gpu="a100-40gb", model="llama-3.1-8b", space=space)
    oracle = phase_oracle(phases, result.trials, result.best)
    assert oracle is not None and oracle["candidates"] == 3
    assert all(row["gain"] >= 1.0 for row in oracle["phases"]) and oracle["replay_gain"] >= 1.0
    checked = 0
    for k, row in enumerate(oracle["phases"]):
        if not row["alone"]:
            continue
        part = Phases(parts=(phases.parts[k],))
        cfg = sim_config({**start, **row["best_args"]}, gpu="a100-40gb", model="llama-3.1-8b")
        alone = simulate_paced(cfg, part.specs(), pacing)
        assert phase_scores(part, alone.answer_s)[0] == pytest.approx(row["score"], rel=1e-3), k
        checked += 1
    assert checked >= 2
