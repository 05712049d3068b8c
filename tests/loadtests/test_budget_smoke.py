"""The output budget's benchmark, small: its arms and report on made-up figures, the workloads in
virtual time through the proxy's own fast tier, and one tiny live run (real ``pacer serve`` processes
in front of ``pacer sim`` workers). Checks the report's shape and the mechanics, not the benchmark's
targets (timings on a shared test machine prove nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.budget import ARMS, aggregate, arm_control, long_answers, table, workloads
from loadtests.budget_replay import replay
from loadtests.scenario_proxy import shipped_control

ROOT = Path(__file__).resolve().parents[2]


def test_the_arms_differ_from_the_shipped_control_only_where_they_say() -> None:
    shipped = shipped_control()
    assert arm_control("budget") == (shipped["mode"], shipped)
    mode, control = arm_control("no-budget")
    assert mode == shipped["mode"] and control == {**shipped, "output_budget": False}
    assert arm_control("off")[0] == "off"
    with pytest.raises(ValueError):
        arm_control("oracle")


def test_the_mix_has_a_long_phase_and_the_bursty_chat_none() -> None:
    chosen = workloads(count=1000)
    mix, bursty = chosen["mix"], chosen["bursty"]
    long, requests = long_answers(mix), mix.workload.requests()
    assert len(long) == 5 and all(requests[i][2] >= 1000 for i in long)
    assert all(requests[i][2] <= 500 for i in set(range(len(requests))) - set(long))
    assert long_answers(bursty) == [] and max(r[2] for r in bursty.workload.requests()) <= 500
    assert mix.workload.count == bursty.workload.count == 1000


def _figures(ttft: float, tok: float) -> dict[str, object]:
    return {"ttft_p50_ms": ttft, "ttft_p99_ms": 10 * ttft, "e2e_p50_s": 1.0, "e2e_p99_s": 2.0, "long_e2e_p99_s": None,
            "long_after_first_p99_s": None, "last_answer_s": 60.0, "output_tok_per_s": tok, "sim_slowdown": 1.0,
            "load_avg": [1.0, 2.0], "cpu": {"proxy": {"cores": 0.3, "cpu_wait": 0.05}}}  # fmt: skip


def test_medians_over_the_rounds_and_the_budget_arm_s_ratios() -> None:
    rounds = [{"budget": _figures(40.0, 1100.0), "no-budget": _figures(50.0, 1000.0), "off": _figures(80.0, 1000.0)},
              {"budget": _figures(60.0, 1100.0), "no-budget": _figures(50.0, 1000.0), "off": _figures(80.0, 1000.0)}]  # fmt: skip
    summary = aggregate(rounds)
    assert summary["medians"]["budget"]["ttft_p50_ms"] == 50.0
    assert summary["ratios"]["budget/off"]["ttft_p50_ms"] == 0.625
    assert summary["ratios"]["budget/no-budget"]["output_tok_per_s"] == 1.1
    assert summary["ratios"]["budget/off"]["long_e2e_p99_s"] is None  # no long answers: no ratio
    assert summary["cpu_wait_max"] == ("proxy", 0.05) and summary["load_avg_range"] == [1.0, 2.0]
    text = table({"workloads": {"bursty": {"summary": summary, "rounds_run": 2}}})
    assert "| budget/off |" in text and "long_e2e_p99_s" not in text


def test_in_virtual_time_the_budget_continues_the_long_answers_and_chat_alone_is_never_held_back() -> None:
    mix = workloads(count=1000)["mix"]
    long = long_answers(mix)
    on, off = replay(mix, "budget"), replay(mix, "off")
    assert sum(on.parts[i] > 1 for i in long) >= 1 and all(p == 1 for p in off.parts)
    assert all(on.answered[i] - on.arrival[i] > 0 for i in range(mix.workload.count))
    assert any(b == 768 for *_, b in on.moves)  # the short answers' budget
    assert all(limit is None for _, limit, *_ in on.moves)  # interactive work alone: no admission limit
    assert on.summary()["ttft_p99_s"] <= off.summary()["ttft_p99_s"]


@pytest.mark.timeout(180)
def test_a_tiny_run_reports_every_arm_side_by_side(tmp_path: Path) -> None:
    report_path = tmp_path / "budget.json"
    # twice the default rate: the mix's one long answer arrives sooner, and the run ends with it
    cmd = [sys.executable, "-m", "loadtests", "budget", "--workloads", "mix", "--rounds", "1", "--count", "60",
           "--rate", "14", "--time-scale", "50", "--report", str(report_path),
           "--workdir", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    (figures,) = report["workloads"]["mix"]["rounds"]
    assert set(figures) == set(ARMS) and sorted(f["order"] for f in figures.values()) == [1, 2, 3]
    for arm, f in figures.items():
        assert f["requests_ok"] == 60 and f["requests_failed"] == f["requests_lost"] == 0, arm
        assert f["ttft_p50_ms"] > 0 and f["long_answered"] == 1, arm
        assert {"client", "proxy", "workers"} <= set(f["cpu"]), arm
    assert figures["off"]["continuations"] == 0 and figures["off"]["limits"] == []
    assert "| budget/off |" in report_path.with_suffix(".md").read_text()
