"""The batch benchmark end to end at a tiny scale: real ``pacer sim`` workers, a real ``pacer serve``
with the Batch API, the openai client. Checks the report's shape and that every line was answered
once, not the benchmark's targets (timings on a shared test machine prove nothing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_batch_benchmark_tiny_run(tmp_path: Path) -> None:
    report_path = tmp_path / "batch.json"
    cmd = [sys.executable, "-m", "loadtests", "batch", "--report", str(report_path), "--log-dir", str(tmp_path / "logs"),
           "--lines", "120", "--sweep-requests", "60", "--concurrency", "16", "64", "--output-len", "16",
           "--interactive-rate", "80", "--interactive-requests", "10", "--interactive-delay", "0.1", "--rounds", "2",
           "--interactive-len", "8", "--time-scale", "50", "--poll-s", "0.05",
           "--max-running", "24", "--designs", "shipped", "priority"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert [p["concurrency"] for p in report["sweep"]] == [16, 64]
    best = max(report["sweep"], key=lambda p: p["requests_per_s"])["concurrency"]
    assert report["direct"]["concurrency"] == best and report["direct"]["errors"] == 0
    # the shipped [pacing] in front of an external FCFS worker and of one the proxy starts with priority
    # scheduling, side by side, each on fresh workers; its protection's numbers read from the worker
    assert report["pacing_is_shipped"] and "batch_in_flight_beside_interactive" not in report["pacing"]
    for design in ("shipped", "priority"):
        d = report[design]
        assert d["running_limits"] == [24]
        b = d["batch"]
        assert b["status"] == "completed" and b["ok"] == b["distinct_ids"] == b["completed"] == 120, b
        assert b["error_lines"] == 0 and b["failed"] == 0
        assert [r["order"] for r in d["interactive_rounds"]] == [["alone", "with_batch"], ["with_batch", "alone"]]
        for rnd in d["interactive_rounds"]:
            for arm in ("alone", "with_batch"):
                assert rnd[arm]["errors"] == 0 and rnd[arm]["ok"] == 10
                for who in ("pacer", "worker", "client"):
                    assert 0 <= rnd[arm][f"{who}_cpu_wait_fraction"] < 2
                assert rnd[arm]["client_send_lag_max_ms"] >= rnd[arm]["client_send_lag_p99_ms"] >= 0
            assert rnd["p99_ratio"] == round(rnd["with_batch"]["ttft_p99_ms"] / rnd["alone"]["ttft_p99_ms"], 3)
        summary = d["interactive"]
        assert summary["rounds"] == 2 and summary["alone"]["requests"] == summary["with_batch"]["requests"] == 20
        assert summary["p99_ratios"] == [r["p99_ratio"] for r in d["interactive_rounds"]]
        lo, hi = sorted(summary["p99_ratios"])
        assert summary["p99_ratio_median"] == pytest.approx((lo + hi) / 2, abs=1e-3)
        for key in ("batch_vs_direct_throughput", "interactive_p99_ttft_ratio"):
            assert isinstance(d[key], float) and math.isfinite(d[key]) and d[key] > 0
        assert set(d["targets"]) == {"batch_vs_direct_throughput >= 0.97", "interactive_p99_ttft_ratio <= 1.5"}
    assert report["batch"] == report["shipped"]["batch"]  # the headline keys: the first design's
