"""The overhead benchmark end to end at a tiny scale: real worker, real ``pacer serve``, real
sglang-router, all three arms. Checks the report's shape and that the values are sane, not the
benchmark's targets (timings on a shared test machine prove nothing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests.loadgen import percentile
from loadtests.procs import port_is_free, start_sim

ROOT = Path(__file__).resolve().parents[2]
ARM_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "output_tok_per_s", "chunks_per_s")
TOP_KEYS = ("pacer_added_ttft_p50_ms", "pacer_added_ttft_p99_ms", "pacer_throughput_ratio")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(240)
def test_overhead_benchmark_tiny_run_reports_every_arm(tmp_path: Path) -> None:
    report_path = tmp_path / "overhead.json"
    cmd = [
        sys.executable,
        "-m",
        "loadtests",
        "overhead",
        "--report",
        str(report_path),
        "--log-dir",
        str(tmp_path / "logs"),
        "--rate",
        "40",
        "--duration",
        "1",
        "--warmup",
        "0.3",
        "--rounds",
        "1",
        "--output-len",
        "8",
        "--stream-concurrency",
        "8",
        "--stream-output-len",
        "300",
        "--stream-warmup",
        "0.5",
        "--stream-window",
        "1",
        "--stream-time-scale",
        "20",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| pacer |" in done.stdout and "| sglang-router |" in done.stdout  # the table was printed

    report = json.loads(report_path.read_text())
    for arm in ("direct", "pacer", "sglang-router"):
        a = report[arm]
        for key in ARM_KEYS:
            assert isinstance(a[key], (int, float)) and math.isfinite(a[key]), (arm, key, a[key])
        assert 0 < a["ttft_p50_ms"] <= a["ttft_p99_ms"] < 10_000, (arm, a)
        assert a["output_tok_per_s"] > 0 and a["chunks_per_s"] > 0, (arm, a)
        assert a["errors"] == 0, (arm, report["rounds"])
    for key in TOP_KEYS:
        assert isinstance(report[key], (int, float)) and math.isfinite(report[key]), (key, report[key])
    # every request of the tiny run got its whole answer through each arm, so throughputs are alike
    assert 0.5 < report["pacer_throughput_ratio"] < 2.0
    latency = report["rounds"]["latency"][0]
    for arm in ("direct", "pacer", "sglang-router"):
        assert latency[arm]["ok"] == latency[arm]["requests"] == 40
        assert latency[arm]["output_tokens"] == 40 * 8  # ignore_eos: exactly max_tokens each
    # the pacer and the router spent CPU relaying the streaming phase
    assert report["pacer"]["chunks_per_cpu_s"] > 0 and report["sglang-router"]["chunks_per_cpu_s"] > 0
    # the added latency is the per-round difference against direct
    assert report["pacer_added_ttft_p50_ms"] == pytest.approx(
        latency["pacer"]["ttft_p50_ms"] - latency["direct"]["ttft_p50_ms"], abs=1e-3
    )

    assert report["pacer_cpu_ms_per_request"] > 0 and report["router_cpu_ms_per_request"] > 0
    assert 0 <= report["pacer"]["client_send_lag_p99_ms"] < 10_000
    # the proxy and the router on a CPU of their own, the worker and the client on the others
    if len(os.sched_getaffinity(0)) >= 2:
        pins = report["cpu_affinity"]
        assert pins["pacer"] == pins["sglang-router"] and len(pins["pacer"]) == 1
        assert pins["worker"] == pins["client"] and not set(pins["pacer"]) & set(pins["worker"])

    # every process the benchmark started is gone and its ports are free again
    procs = report["processes"]
    assert {p["name"] for p in procs} == {
        f"{tag}-{n}" for tag in ("latency", "stream") for n in ("sim", "pacer", "sglang-router")
    }
    deadline = time.monotonic() + 10
    while any(_alive(p["pid"]) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if _alive(p["pid"])]
    assert all(port_is_free(port) for p in procs for port in p["ports"])


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([5.0, 1.0], 50) == 1.0


@pytest.mark.timeout(90)
def test_started_process_is_pinned_to_the_cpus_asked(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    with start_sim(tmp_path, time_scale=100, cpus=frozenset({cpu})) as sim:
        assert os.sched_getaffinity(sim.pid) == {cpu}
        assert all(os.sched_getaffinity(int(t.name)) == {cpu} for t in Path(f"/proc/{sim.pid}/task").iterdir())
