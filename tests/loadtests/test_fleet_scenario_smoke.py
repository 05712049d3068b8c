"""The fleet scenario's machinery, small and time-scaled: two simulated workers in one pool (one
started with its own flag), arrivals over time, control ``auto`` as shipped, and the arm with
an operator's trial injected through ``POST /admin/trial``. Every request answered once; the report
has the fleet's top-level figures; the injected bad candidate is judged by the canary and reverted;
at most one worker of the two is out at any sample."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loadtests.scenario_defs import SCENARIOS, Scenario, Trial, Workload
from loadtests.scenarios import TRIAL_ARM, policy_toml, run_scenario
from proxy.policy import load_policy


def test_the_fleet_scenario_policy_starts_one_worker_with_its_own_flag(tmp_path: Path) -> None:
    sc = SCENARIOS["fleet"]
    path = tmp_path / "policy.toml"
    path.write_text(policy_toml(sc, sc.start_args, "auto", tmp_path, sc.worker_args))
    engine = load_policy(path).engine
    assert engine.workers == 4 and [dict(a) for a in engine.worker_args] == [{}, {}, {}, {"max_running_requests": 64}]
    assert sc.trial is not None and sc.trial.worker == "w0"


@pytest.mark.long
@pytest.mark.timeout(300)
def test_tiny_fleet_with_an_injected_trial(tmp_path: Path) -> None:
    # 20x: the simulator keeps its clock and the proxy's scrapes still resolve the canary's window. w1's own
    # flag is the fleet scenario's cap: a much tighter one left w1 a backlog it served long after the revert.
    # The arrivals end about when the revert is done; the canary's requests taken back then outlast it.
    sc = Scenario(
        name="tiny-fleet",
        premise="test",
        workload=Workload(count=500, prompt_len=(100, 300), max_tokens=4096, output_len=(600, 900), seed=5, rate=5.0),
        start_args={"schedule_conservativeness": 0.3},
        worker_args=({}, {"max_running_requests": 64}),
        workers=2,
        trial=Trial(at_s=30.0, worker="w0", args={"max_running_requests": 2}, note="smoke"),
        gpu="a100-40gb",
        time_scale=20.0,
    )
    report_path = tmp_path / "tiny-fleet.json"
    run_scenario(sc, report_path, arms=("adaptive", TRIAL_ARM), workdir=tmp_path / "work", max_run_s=120)
    report = json.loads(report_path.read_text())
    assert report["lost"] == 0
    for arm in ("adaptive", TRIAL_ARM):
        a = report["arms"][arm]
        assert a["requests_ok"] == 500 and a["requests_failed"] == 0, (arm, a)
        assert set(a["final_args"]) == {"w0", "w1"}
    assert report["min_serving_fraction"] >= 0.5  # one worker of two out at a time, at most
    if sys.platform == "linux":  # the plans ran in the planner's process, its memory read from /proc
        assert 20 < report["arms"]["adaptive"]["planner_peak_rss_mb"] < 2000
    injection = report["injection"]
    assert injection["sent"]["status"] == 202 and injection["canary_verdict"] == "revert", injection
    assert injection["revert_status"] == "applied" and injection["reverted_after_modelled_s"] > 0
    assert (
        injection["canary_share_after"] < injection["canary_share_before"] or injection["canary_share_before"] is None
    )
    assert report["arms"][TRIAL_ARM]["final_args"]["w0"].get("max_running_requests") != 2
    assert isinstance(report["revert_cost"], float)
    for key in ("adaptive_over_best_static", "adaptive_over_default", "prediction_error_median", "restarts"):
        assert key in report
    assert report_path.with_suffix(".png").stat().st_size > 10_000
