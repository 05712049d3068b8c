"""The per-phase oracle of a shift (loadtests.phase_oracle): each phase's best arguments among the
sweep's trials, scored on that phase inside the trial's replay, and the adaptive arm judged against it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from loadtests.oracle import Pacing, SearchSpace, Trial, sim_config, simulate_paced, sweep
from loadtests.phase_oracle import Replay, adaptive_over_phase_oracle, phase_oracle, phase_scores, switchable
from loadtests.scenario_defs import SCENARIOS, Phases, Workload
from proxy.request.pacing import Band
from proxy.sim.request import RequestSpec

# chat arriving at 1 per second for 2 s (requests 0, 1), then a batch of two at 10 s (requests 2, 3)
TWO = Phases(parts=(
    Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), rate=1.0, seed=1),
    Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), start_s=10.0, seed=2),
))  # fmt: skip


def _trial(args: dict[str, float], score: float = 1.0) -> Trial:
    return Trial(args=args, output_tok_per_s=score)


def _replay_from(table: dict[float, tuple[float, ...]]) -> Replay:
    """A replay given as a table: per schedule_conservativeness, the answer times of the whole trace;
    a phase replayed alone gets its own requests' (they are told apart by their arrival)."""
    arrivals = TWO.arrivals()

    def replay(args: Mapping[str, Any], specs: Sequence[RequestSpec]) -> list[float]:
        times = table[args["schedule_conservativeness"]]
        first = arrivals.index(specs[0].arrival)
        return list(times[first : first + len(specs)])

    return replay


def test_a_shift_can_be_switched_between_and_a_mix_cannot() -> None:
    assert switchable(SCENARIOS["shift"].workload) and switchable(SCENARIOS["shift-perturbed"].workload)
    assert not switchable(SCENARIOS["mixed"].workload)  # its phases arrive together, the chat streamed
    assert switchable(TWO)


def test_each_phase_takes_the_arguments_that_serve_it_best_alone() -> None:
    """The best single arguments (0.3) score 0.5 on the chat (mean answer 2 s) and 5 tok/s on the batch
    (20 tokens in 4 s). 0.1 serves the chat best, 1.0 the batch; 1.0 left a chat request unanswered, so
    it is no choice there; an unsafe trial is no candidate."""
    best = _trial({"schedule_conservativeness": 0.3})
    replay = _replay_from({
        0.3: (2.0, 2.0, 4.0, 4.0),
        0.1: (1.0, 1.0, 8.0, 8.0),
        1.0: (1.0, math.nan, 2.0, 2.0),
        0.5: (0.1, 0.1, 0.1, 0.1),
    })  # fmt: skip
    assert phase_scores(TWO, replay({"schedule_conservativeness": 0.3}, TWO.specs())) == [0.5, 5.0]
    assert phase_scores(TWO, replay({"schedule_conservativeness": 1.0}, TWO.specs())) == [0.0, 10.0]
    trials = [best, _trial({"schedule_conservativeness": 0.1}), _trial({"schedule_conservativeness": 1.0}),
              Trial(args={"schedule_conservativeness": 0.5}, output_tok_per_s=0.0, unsafe=True)]  # fmt: skip
    oracle = phase_oracle(TWO, trials, best, replay)
    assert oracle is not None and oracle["candidates"] == 3
    chat, batch = oracle["phases"]
    assert (chat["best_args"], chat["score"], chat["gain"]) == ({"schedule_conservativeness": 0.1}, 1.0, 2.0)
    assert (batch["best_args"], batch["score"], batch["gain"]) == ({"schedule_conservativeness": 1.0}, 10.0, 2.0)
    assert chat["switched"] and batch["switched"] and oracle["replay_gain"] == 2.0
    assert chat["alone"] and batch["alone"]  # 0.1's chat answered by 4.5 s, the batch came at 10 s
    # nothing beats the best single arguments: no switch, gain 1
    still = phase_oracle(TWO, [best], best, replay)
    assert still is not None and [(r["switched"], r["gain"]) for r in still["phases"]] == [(False, 1.0), (False, 1.0)]
    # a chat still answering when the batch comes (its second answer at 13 s): the free switch is not exact
    late = phase_oracle(TWO, [best], best, _replay_from({0.3: (3.0, 9.5, 4.0, 4.0)}))
    assert late is not None and [(r["switched"], r["alone"]) for r in late["phases"]] == [(False, True), (False, False)]
    assert phase_oracle(SCENARIOS["mixed"].workload, trials, best, replay) is None  # type: ignore[arg-type]
    # the best single arguments answer nobody in a phase: no oracle to scale
    assert phase_oracle(TWO, [best], best, _replay_from({0.3: (1.0, 1.0, math.nan, 2.0)})) is None


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


def test_on_a_real_sweep_each_phase_is_replayed_alone_under_its_own_best_arguments() -> None:
    """A tiny shift swept in virtual time: chat, a batch of outputs near max_tokens, chat. Every gain is
    at least 1; a phase that switched scores what its arguments serve replayed by themselves."""
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

    def replay(args: Mapping[str, Any], specs: Sequence[RequestSpec]) -> Sequence[float]:
        return simulate_paced(sim_config(args, gpu="a100-40gb", model="llama-3.1-8b"), specs, pacing).answer_s

    oracle = phase_oracle(phases, result.trials, result.best, replay)
    assert oracle is not None and oracle["candidates"] == 3
    assert all(row["gain"] >= 1.0 for row in oracle["phases"]) and oracle["replay_gain"] >= 1.0
    assert all(row["alone"] for row in oracle["phases"])  # the phases are spaced to drain in between
    switched = [row for row in oracle["phases"] if row["switched"]]
    assert switched  # other arguments than the best single ones serve at least one phase better
    for row in switched:
        part = Phases(parts=(phases.parts[row["phase"]],))
        assert phase_scores(part, replay({**start, **row["best_args"]}, part.specs()))[0] == pytest.approx(row["score"])
        assert row["gain"] > 1.0
