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
           "--interactive-rate", "10", "--interactive-duration", "1", "--interactive-delay", "0.2",
           "--interactive-len", "8", "--time-scale", "50"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert [p["concurrency"] for p in report["sweep"]] == [16, 64]
    best = max(report["sweep"], key=lambda p: p["requests_per_s"])["concurrency"]
    assert report["direct"]["concurrency"] == best and report["direct"]["errors"] == 0
    for design in ("band", "priority", "cap", "priority-cap"):  # every design side by side, each on fresh workers
        d = report[design]
        for name in ("batch", "batch_during_interactive"):
            b = d[name]
            assert b["status"] == "completed" and b["ok"] == b["distinct_ids"] == b["completed"] == 120, b
            assert b["error_lines"] == 0 and b["failed"] == 0
        for name in ("interactive_alone", "interactive_with_batch"):
            assert d[name]["errors"] == 0 and d[name]["ok"] == 10
        for key in ("batch_vs_direct_throughput", "interactive_p99_ttft_ratio"):
            assert isinstance(d[key], float) and math.isfinite(d[key]) and d[key] > 0
        assert set(d["targets"]) == {"batch_vs_direct_throughput >= 0.97", "interactive_p99_ttft_ratio <= 1.5"}
    assert report["batch"] == report["band"]["batch"]  # the headline keys: the first design's
