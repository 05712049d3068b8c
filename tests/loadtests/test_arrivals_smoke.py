"""Arrivals over time and phased workloads (loadtests.scenario_defs), and the per-phase figures of a report."""

from __future__ import annotations

import itertools
import statistics

import pytest

from loadtests.scenario_arm import ArmResult
from loadtests.scenario_defs import SCENARIOS, Phases, Workload
from loadtests.scenario_report import _phase_figures


def _gaps(w: Workload) -> list[float]:
    a = w.arrivals()
    return [b - x for x, b in itertools.pairwise(a)]


def test_arrivals_are_seeded_at_the_mean_rate_and_bursty_ones_clump():
    poisson = Workload(count=4000, prompt_len=(1, 2), max_tokens=10, output_len=(1, 10), seed=5, rate=4.0)
    bursty = Workload(count=4000, prompt_len=(1, 2), max_tokens=10, output_len=(1, 10), seed=5, rate=4.0, shape=0.3)
    assert poisson.arrivals() == poisson.arrivals()
    for w in (poisson, bursty):
        assert statistics.mean(_gaps(w)) == pytest.approx(0.25, rel=0.08)
    cv = [statistics.pstdev(_gaps(w)) / statistics.mean(_gaps(w)) for w in (poisson, bursty)]
    assert 0.9 < cv[0] < 1.1 and cv[1] > 1.5  # gamma(0.3): cv = 1/sqrt(0.3) = 1.83
    batch = Workload(count=3, prompt_len=(1, 2), max_tokens=10, output_len=(1, 10), start_s=7.0)
    assert batch.arrivals() == [7.0, 7.0, 7.0]
    assert [s.arrival for s in batch.specs()] == [7.0, 7.0, 7.0]


def test_phases_keep_requests_arrivals_and_phase_indices_aligned():
    sc = SCENARIOS["shift"]
    wl = sc.workload
    assert isinstance(wl, Phases)
    assert len(wl.requests()) == len(wl.arrivals()) == len(wl.phase_of()) == wl.count == len(wl.specs())
    chat, batch, chat_again = wl.parts
    assert chat.rate is not None and batch.rate is None and chat_again.start_s > batch.start_s
    assert max(o for _, _, o in batch.requests()) <= batch.max_tokens


def test_phase_figures_judge_arrivals_on_queue_time_and_a_batch_on_throughput():
    parts = (
        Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), rate=1.0, seed=1),
        Workload(count=2, prompt_len=(1, 2), max_tokens=10, output_len=(10, 10), start_s=100.0),
    )
    sc = SCENARIOS["shift"].__class__(name="t", premise="", workload=Phases(parts=parts), start_args={},
                                      time_scale=10.0)  # fmt: skip
    arm = ArmResult(arm="adaptive", args={}, control_mode="auto", latencies={0: 0.1, 1: 0.2, 2: 1.0, 3: 2.0})
    rows = _phase_figures(sc, {"adaptive": arm})
    assert rows is not None and [r["judged_on"] for r in rows] == ["queue time", "throughput"]
    assert rows[0]["adaptive"]["mean_s"] == 1.5  # wall 0.1, 0.2 x time scale 10
    assert rows[1]["adaptive"]["tok_per_s"] == 20 / 20.0  # 20 tokens from 100 s to the last answer at 120 s


def test_the_perturbed_shift_runs_its_workers_and_its_sweep_on_the_hidden_factors():
    from loadtests.oracle import sim_config

    sc = SCENARIOS["shift-perturbed"]
    assert sc.perturb_args() == ["--sim-step-time-factor", "1.25", "--sim-activation-factor", "0.8"]
    assert sc.extra_args()[-4:] == sc.perturb_args() and SCENARIOS["shift"].perturb_args() == []
    cfg = sim_config(sc.start_args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args())
    assert (cfg.step_time_factor, cfg.activation_factor) == (1.25, 0.8)
    assert "sim_step_time_factor" not in cfg.server_args  # the twin is not told


@pytest.mark.parametrize("premise", ["early-stop", "retraction-storm", "prefill-oom", "decode-oom", "low-mem-fraction"])
def test_the_perturbed_premises_are_the_poisson_hour_on_a_slower_engine_with_larger_activations(premise: str):
    """The same premise, arrivals 25 % slower on an engine 25 % slower, activations 25 % larger: the
    workers and the sweep run the hidden factors (the controller runs the shipped [control])."""
    base, sc = SCENARIOS[f"{premise}-poisson"], SCENARIOS[f"{premise}-poisson-perturbed"]
    assert sc.perturb_args() == ["--sim-step-time-factor", "1.25", "--sim-activation-factor", "1.25"]
    assert base.perturb_args() == [] and sc.start_args == base.start_args and sc.judged_on == base.judged_on
    arrived = sc.workload.arrivals()
    horizon = 900.0 if premise == "decode-oom" else 3600.0  # decode-oom: a quarter hour
    assert max(arrived) <= horizon < max(arrived) + 60.0  # the horizon's arrivals
    assert sc.workload.count == pytest.approx(base.workload.count / 1.25, rel=0.06)
