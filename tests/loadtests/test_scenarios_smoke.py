"""Scenario benchmark, small: the oracle's sweep in virtual time, and one tiny scenario run end to end
(three real ``pacer serve`` processes in front of ``pacer sim`` workers)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtests.oracle import SearchSpace, evaluate, sweep
from loadtests.scenario_defs import SCENARIOS, Scenario, Workload
from loadtests.scenarios import (
    ARM_KEYS,
    ARMS,
    SHIPPED_POLICY,
    control_hash,
    main,
    policy_toml,
    run_scenario,
    shipped_control,
)
from proxy.policy import load_policy
from proxy.sim.request import RequestSpec

SMALL = SearchSpace(
    schedule_conservativeness=(0.1, 0.5, 1.0, 1.6),
    chunked_prefill_size=(None, 4096, 8192),
    max_running_requests=(None, 64, 256),
    mem_fraction_static=(None, 0.85, 0.9),
    passes=1,
)


def test_sweep_beats_aggressive_admission() -> None:
    """A pool of 30k tokens and conservativeness 0.1: the sweep finds arguments that finish sooner."""
    wl = Workload(count=120, prompt_len=(100, 300), max_tokens=800, output_len=(600, 800), seed=3).specs()
    start = {"schedule_conservativeness": 0.1, "max_total_tokens": 30000}
    result = sweep(start, wl, gpu="a100-40gb", model="llama-3.1-8b", space=SMALL)
    assert result.start.retractions > 0
    assert result.best.score > result.start.score * 1.02
    assert result.best.args != result.start.args
    assert result.best.args["max_total_tokens"] == 30000  # only the four knobs move
    assert result.best.makespan_s < result.start.makespan_s


def test_sweep_turns_a_crash_into_throughput() -> None:
    """A prefill chunk whose activations do not fit scores zero; the sweep finds one that runs."""
    wl = Workload(count=40, prompt_len=(3000, 5000), max_tokens=64, output_len=(16, 64), seed=4).specs()
    start = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    bad = evaluate(start, wl, gpu="l40s-48gb", model="llama-3.1-8b")
    assert bad.oom == "prefill" and bad.score == 0.0
    result = sweep(start, wl, gpu="l40s-48gb", model="llama-3.1-8b", space=SMALL)
    assert result.best.oom is None and result.best.score > 0
    assert (
        result.best.args["chunked_prefill_size"] in (None, 4096, 8192) or result.best.args["mem_fraction_static"] != 0.9
    )


def test_sweep_respects_the_free_memory_floor() -> None:
    wl = Workload(count=30, prompt_len=(100, 200), max_tokens=100, output_len=(50, 100), seed=5).specs()
    result = sweep({}, wl, gpu="h100-80gb", model="llama-3.1-8b", space=SearchSpace(min_available_gb=5.0, passes=1))
    assert all(t.available_gpu_mem_gb is None or t.unsafe or t.available_gpu_mem_gb >= 5.0 for t in result.trials)
    assert result.best.available_gpu_mem_gb is not None and result.best.available_gpu_mem_gb >= 5.0
    assert any(t.unsafe for t in result.trials)  # mem_fraction_static 0.93 leaves too little: not a candidate


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_runs_the_shipped_control(name: str, tmp_path: Path) -> None:
    """Every scenario's adaptive arm loads with the shipped policy's [control] settings, every one of
    them as shipped: only the engine and the workload are the scenario's."""
    sc = SCENARIOS[name]
    path = tmp_path / "policy.toml"
    path.write_text(policy_toml(sc, sc.start_args, "auto", tmp_path))
    policy, shipped = load_policy(path), load_policy(SHIPPED_POLICY)
    assert shipped.control.mode.value == "auto" and policy.control == shipped.control
    assert dict(policy.engine.args) == dict(sc.start_args)
    assert policy.engine.extra_args[:6] == ("--sim-gpu", sc.gpu, "--sim-model", sc.model, "--sim-time-scale",
                                            f"{sc.time_scale:g}")  # fmt: skip
    assert policy.engine.stop_grace_s == 5.0  # on the wall clock, whatever the time scale
    static = load_policy_text(policy_toml(sc, {}, "off", tmp_path), tmp_path).control
    assert static.mode.value == "off" and static == dataclasses.replace(shipped.control, mode=static.mode)


def load_policy_text(text: str, where: Path) -> Any:
    path = where / "other.toml"
    path.write_text(text)
    return load_policy(path)


def test_a_control_table_other_than_the_shipped_one_is_written_as_given(tmp_path: Path) -> None:
    sc = SCENARIOS["early-stop"]
    other = {**shipped_control(), "restarts_per_hour": 1}
    policy = load_policy_text(policy_toml(sc, sc.start_args, "auto", tmp_path, control=other), tmp_path)
    assert policy.control.restarts_per_hour == 1 != load_policy(SHIPPED_POLICY).control.restarts_per_hour
    assert (
        control_hash(other)
        != control_hash(shipped_control())
        == control_hash(dict(reversed(shipped_control().items())))
    )


def _head(sc: Scenario, count: int) -> list[RequestSpec]:
    """The first ``count`` requests of a scenario's workload, without building the rest."""
    assert isinstance(sc.workload, Workload) and sc.workload.count >= count
    return dataclasses.replace(sc.workload, count=count).specs()


def test_workload_is_deterministic_and_exact() -> None:
    wl = Workload(count=5, prompt_len=(10, 20), max_tokens=50, output_len=(5, 60), seed=9)
    assert wl.requests() == wl.requests()
    arriving = dataclasses.replace(wl, rate=2.0)  # a head is the smaller count's, arrivals too (_head)
    assert dataclasses.replace(arriving, count=3).specs() == arriving.specs()[:3]
    for spec, (_, max_tokens, out) in zip(wl.specs(), wl.requests(), strict=True):
        assert 10 <= len(spec.prompt_ids or ()) <= 20
        assert spec.output_len == out <= max_tokens == 50


def test_cli_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["no-such-scenario"])
    with pytest.raises(SystemExit):
        main(["early-stop", "--arms", "default,best"])
    assert "unknown arm" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_tiny_scenario_report_has_every_key(tmp_path: Path) -> None:
    """Three arms of a tiny retraction storm through real proxies: every request answered, the report complete."""
    sc = Scenario(
        name="tiny-storm",
        premise="test",
        workload=Workload(count=60, prompt_len=(50, 150), max_tokens=300, output_len=(200, 300), seed=1),
        start_args={"schedule_conservativeness": 0.1, "max_total_tokens": 6000, "max_running_requests": 64},
        gpu="a100-40gb",
        time_scale=40.0,
    )
    report_path = tmp_path / "tiny.json"
    report = run_scenario(sc, report_path, workdir=tmp_path / "work", max_run_s=120)
    on_disk = json.loads(report_path.read_text())
    assert set(on_disk["arms"]) == set(ARMS)
    for arm in ARMS:
        a = on_disk["arms"][arm]
        assert set(ARM_KEYS) <= set(a), arm
        assert a["requests_lost"] == 0 and a["requests_failed"] == 0 and a["requests_ok"] == 60, (arm, a)
        assert a["output_tok_per_s"] > 0
        if sys.platform == "linux":  # the proxy's peak resident memory, read from /proc before it stops
            assert 20 < a["proxy_peak_rss_mb"] < 2000, (arm, a["proxy_peak_rss_mb"])
            planner_mb = a["planner_peak_rss_mb"]
            if a["control_mode"] == "off":  # no controller: no planner's process
                assert planner_mb is None, (arm, planner_mb)
            else:  # its process starts at its first plan or budget prediction, if the run lasts that long
                assert planner_mb is None or 0 < planner_mb < 2000, (arm, planner_mb)
    assert on_disk["arms"]["default"]["retractions"] > 0  # the storm is real
    assert on_disk["arms"]["oracle"]["control_mode"] == "off"
    # the adaptive arm ran the shipped [control], and the report says so
    assert on_disk["control_is_shipped"] is True and on_disk["control"] == shipped_control()
    assert on_disk["control_hash"] == on_disk["shipped_control_hash"] == control_hash(shipped_control())
    assert on_disk["adaptive_over_phase_oracle"] is None and on_disk["phase_oracle"] is None  # one phase
    # each arm's proxy ran in its own directory: the shipped relative paths (journal, batch store) land there
    assert all((tmp_path / "work" / arm / ".pacer").is_dir() for arm in ARMS)
    for key in ("adaptive_over_oracle", "adaptive_over_default"):
        assert isinstance(on_disk[key], float) and on_disk[key] > 0
    assert report["oracle_sweep"]["best"]["args"] == on_disk["arms"]["oracle"]["args"] | {
        k: v for k, v in report["oracle_sweep"]["best"]["args"].items() if v is None
    }
    assert report_path.with_suffix(".png").stat().st_size > 10_000
    table = report_path.with_suffix(".md").read_text()
    assert "| tiny-storm | adaptive |" in table and "adaptive / oracle" in table and "| shipped |" in table
    bound = on_disk["restart_bound"]  # what a restart at the controller's moment costs, replayed
    moved = on_disk["arms"]["adaptive"]["restarts"] > 0
    looked = any(d["rule"] == "planner" for d in on_disk["decisions"]["adaptive"])
    if not (moved or looked):  # too short a run for a look: no moment to price
        assert bound is None
        return
    assert bound["restart_at"] == ("its restart" if moved else "its first look")
    assert bound["restart_at_modelled_s"] >= 0 and 0 < bound["oracle_args_restarted"] <= 1.0
    assert bound["oracle_args_static"] == 1.0 and bound["adaptive_final_args_static"] > 0
    assert 0 < bound["oracle_args_restarted_at_0"] <= 1.0
    if not moved:  # the proxy's own levers at its arguments: at least those arguments as they ran
        assert bound["no_restart_best"] >= bound["adaptive_final_args_static"]


def test_paced_replay_is_the_queued_one_when_the_gate_never_closes() -> None:
    """The paced replay drives the same engine as proxy.sim.virtual.simulate: with a gate wider than
    the workload, everything arrives at once and the two agree exactly."""
    from loadtests.oracle import Pacing, sim_config, simulate_paced
    from proxy.request.pacing import Band
    from proxy.sim.virtual import simulate

    wl = Workload(count=150, prompt_len=(100, 300), max_tokens=600, output_len=(300, 600), seed=6).specs()
    cfg = sim_config(
        {"schedule_conservativeness": 0.3, "max_total_tokens": 40000}, gpu="a100-40gb", model="llama-3.1-8b"
    )
    queued, wide = simulate(cfg, wl), simulate_paced(cfg, wl, Pacing(band=Band(lo=10**6, hi=10**6), scrape_s=5.0))
    assert (wide.output_tokens, wide.retractions, wide.finished) == (
        queued.output_tokens,
        queued.retractions,
        queued.finished,
    )
    assert wide.makespan_s == pytest.approx(queued.makespan_s)
    narrow = simulate_paced(cfg, wl, Pacing(band=Band(lo=8, hi=8), scrape_s=5.0))
    assert narrow.finished == 150 and narrow.output_tokens == queued.output_tokens
    assert narrow.makespan_s != pytest.approx(queued.makespan_s)  # the arrival process matters


def test_the_replay_keeps_an_lpm_queue_past_its_limit_where_asked() -> None:
    """prefix-none's unique prompts at its start (lpm): the gate's queue past lpm's limit (no matching)
    writes more than at it (matching every round)."""
    from loadtests.oracle import sim_config, simulate_paced
    from loadtests.scenarios import scenario_pacing

    sc = SCENARIOS["prefix-none"]
    head = _head(sc, 1500)
    cfg = sim_config(sc.start_args, gpu=sc.gpu, model=sc.model)
    at, past = (simulate_paced(cfg, head, scenario_pacing(sc), queue_past=p) for p in (False, True))
    assert at.finished == past.finished == 1500
    assert past.output_tok_per_s > 1.05 * at.output_tok_per_s


def test_decode_oom_premise_holds_behind_the_proxy() -> None:
    """The scenario's default arguments die of a decode OOM in the paced replay (the arrival the arms
    see), early; the cap the controller picks after it (0.8 x the peak) runs clean."""
    from loadtests.oracle import evaluate
    from loadtests.scenarios import scenario_pacing

    sc = SCENARIOS["decode-oom"]
    head = _head(sc, 3000)
    dead = evaluate(sc.start_args, head, gpu=sc.gpu, model=sc.model, pacing=scenario_pacing(sc))
    assert dead.oom == "decode" and dead.score == 0.0 and dead.makespan_s < 60  # died in the first fill
    capped = evaluate(
        {**sc.start_args, "max_running_requests": 800}, head, gpu=sc.gpu, model=sc.model, pacing=scenario_pacing(sc)
    )
    assert capped.oom is None and capped.output_tok_per_s > 0


def test_a_restart_in_the_replay_costs_its_start_up_and_the_work_taken_back() -> None:
    """The paced replay with one restart: every request still finishes once; a longer start-up costs
    more; a restart at time 0 is the new arguments' static run shifted by the start-up; a worker that
    dies first restarts when it dies."""
    from loadtests.oracle import Pacing, Restart, sim_config, simulate_paced
    from proxy.request.pacing import Band

    wl = Workload(count=200, prompt_len=(100, 300), max_tokens=600, output_len=(300, 600), seed=7).specs()
    pacing = Pacing(band=Band(lo=40, hi=100, headroom=8), scrape_s=2.0)
    a = sim_config({"schedule_conservativeness": 0.1, "max_total_tokens": 30000}, gpu="a100-40gb", model="llama-3.1-8b")
    b = sim_config({"schedule_conservativeness": 1.0, "max_total_tokens": 30000}, gpu="a100-40gb", model="llama-3.1-8b")
    static_b = simulate_paced(b, wl, pacing)
    at_zero = simulate_paced(a, wl, pacing, Restart(at_s=0.0, config=b, startup_s=20.0))
    assert at_zero.finished == 200 and at_zero.output_tokens == static_b.output_tokens
    assert at_zero.makespan_s == pytest.approx(static_b.makespan_s + 20.0)
    early = simulate_paced(a, wl, pacing, Restart(at_s=10.0, config=b, startup_s=20.0))
    late = simulate_paced(a, wl, pacing, Restart(at_s=30.0, config=b, startup_s=20.0))
    slow = simulate_paced(a, wl, pacing, Restart(at_s=10.0, config=b, startup_s=60.0))
    for r in (early, late, slow):
        assert r.finished == 200 and r.output_tokens == static_b.output_tokens and r.oom is None
    assert slow.makespan_s > early.makespan_s

    sc = SCENARIOS["prefill-oom"]
    head = _head(sc, 200)
    dies = sim_config(sc.start_args, gpu=sc.gpu, model=sc.model)
    assert simulate_paced(dies, head, pacing).oom == "prefill"
    fixed = sim_config({**sc.start_args, "chunked_prefill_size": 8192}, gpu=sc.gpu, model=sc.model)
    revived = simulate_paced(dies, head, pacing, Restart(at_s=10**9, config=fixed, startup_s=20.0))
    assert revived.oom is None and revived.finished == 200


@pytest.mark.timeout(240)
def test_tiny_phased_scenario_with_arrivals_and_another_control(tmp_path: Path) -> None:
    """Chat arriving over time (streamed, interactive), then a small batch (batch class), through real
    proxies (one under control, with a [control] other than the shipped one): every request answered
    once, the report's top level and its phases complete, the interactive first tokens timed, the
    control it ran said not to be the shipped one."""
    from loadtests.scenario_defs import Phases

    sc = Scenario(
        name="tiny-shift",
        premise="test",
        workload=Phases(parts=(
            Workload(count=30, prompt_len=(50, 150), max_tokens=400, output_len=(20, 60), seed=2, rate=20.0,
                     priority="interactive", stream=True),
            Workload(count=20, prompt_len=(50, 150), max_tokens=300, output_len=(250, 300), seed=3, start_s=1.0,
                     priority="batch"),
        )),
        start_args={"schedule_conservativeness": 0.3},
        gpu="a100-40gb",
        time_scale=40.0,
    )  # fmt: skip
    other = {**shipped_control(), "restarts_per_hour": 1}
    report = run_scenario(sc, tmp_path / "tiny.json", arms=("default", "adaptive"), workdir=tmp_path / "w",
                          max_run_s=120, control=other)  # fmt: skip
    assert report["control_is_shipped"] is False and report["control"]["restarts_per_hour"] == 1
    assert report["control_hash"] == control_hash(other) != report["shipped_control_hash"]
    assert report["adaptive_over_phase_oracle"] is None  # streamed chat beside a batch: no phase to switch for
    assert report["lost"] == 0 and report["restarts"] == 0
    assert report["plan_gains"] == []  # no plan acted on, none checked
    for arm in ("default", "adaptive"):
        assert report["arms"][arm]["requests_ok"] == 50, arm
    assert isinstance(report["adaptive_over_default"], float)
    assert "prediction_error_median" in report and "adaptive_over_best_static" in report
    assert (
        report["twin_error_median"] is None or 0 <= report["twin_error_median"] < 1
    )  # the twin in sample, when it planned
    chat, batch = report["phases"]
    assert chat["judged_on"] == "time to first token (p99)" and batch["judged_on"] == "throughput"
    assert chat["adaptive"]["mean_s"] > 0 and batch["default"]["tok_per_s"] > 0
    # the streamed interactive class: its first tokens timed, before its answers ended
    assert 0 < chat["adaptive"]["ttft_p99_s"] <= chat["adaptive"]["p99_s"] and "ttft_p99_s" not in batch["default"]
    assert set(report["interactive_ttft_p99_s"]) == {"default", "adaptive"}
    assert report["arms"]["adaptive"]["output_tokens"] == report["arms"]["default"]["output_tokens"]
    assert report["best_static_by_phase"] == "default" and report["adaptive_over_best_static_by_phase"] > 0


def test_a_phased_run_is_judged_phase_by_phase_against_the_toughest_static_arm() -> None:
    from loadtests.scenario_report import _phase_judged

    phases = [
        {"judged_on": "queue time", "adaptive": {"mean_s": 10.0}, "default": {"mean_s": 10.0},
         "defaults": {"mean_s": 20.0}},
        {"judged_on": "throughput", "adaptive": {"tok_per_s": 1100.0}, "default": {"tok_per_s": 1000.0},
         "defaults": {"tok_per_s": 1210.0}},
    ]  # fmt: skip
    judged = _phase_judged(phases)
    # against the operator's args: 1.0 and 1.1; against SGLang's: 2.0 and 0.909
    assert judged["phase_ratios"] == {"default": [1.0, 1.1], "defaults": [2.0, 0.9091]}
    assert judged["best_static_by_phase"] == "default"
    assert judged["adaptive_over_best_static_by_phase"] == round((1.0 * 1.1) ** 0.5, 4)
    assert _phase_judged(None) == {} and _phase_judged([{"judged_on": "throughput"}]) == {}
