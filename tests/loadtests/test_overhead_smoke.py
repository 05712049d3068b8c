"""The overhead benchmark end to end at a tiny scale: real worker, real ``pacer serve``, real
sglang-router, all three arms. Checks the report's shape (the CPU wait per round, rounds over the
limit left out of latency, the headline, the event-loop probes) and that the values are sane, not
the benchmark's targets (timings on a shared test machine prove nothing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.loadgen import percentile
from loadtests.procs import port_is_free, start_sim
from tests.harness.wait import wait_until_blocking

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2
PATHS = {"direct": {"client", "worker"}, "pacer": {"client", "worker", "pacer"},
         "sglang-router": {"client", "worker", "sglang-router"}}  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The benchmark at its smoke size, run once for the tests below: (report, printout)."""
    tmp = tmp_path_factory.mktemp("overhead")
    report_path = tmp / "overhead.json"
    cmd = [sys.executable, "-m", "loadtests", "overhead", "--report", str(report_path), "--log-dir", str(tmp / "logs"),
           "--rate", "80", "--duration", "0.5", "--warmup", "0.1", "--rounds", str(ROUNDS), "--output-len", "8",
           "--stream-concurrency", "8", "--stream-output-len", "300", "--stream-warmup", "0.1",
           "--stream-window", "0.5", "--stream-time-scale", "20"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report_path.read_text()), done.stdout


@pytest.mark.timeout(300)
def test_every_round_prints_and_reports_how_long_its_processes_waited_for_a_cpu(tiny_run: tuple[dict, str]) -> None:
    report, out = tiny_run
    for phase in ("latency", "stream"):
        rounds = report["rounds"][phase]
        assert len(rounds) == ROUNDS
        for rnd, r in enumerate(rounds, 1):
            assert set(r) == set(PATHS)
            for arm, s in r.items():
                waited = s["cpu_wait_fraction"]
                assert {"client", "worker", "pacer", "sglang-router"} <= set(waited)
                assert all(_finite(w) and w >= 0 for w in waited.values()), waited
                role, most = s["waited_most"]
                assert role in PATHS[arm] and most == max(waited[n] for n in PATHS[arm])
                assert s["counted"] is (most < report["starved_at"]) and report["starved_at"] == 0.10
                line = next(x for x in out.splitlines() if x.startswith(f"  round {rnd} {phase:<8} {arm:<14} "))
                assert "waited for a CPU: " in line and all(
                    f"{n} " in line.split("waited for a CPU: ")[1] for n in PATHS[arm]
                )
                assert line.endswith(": counted") if s["counted"] else "STARVED" in line and "not counted" in line


@pytest.mark.timeout(300)
def test_latency_comes_only_from_rounds_under_the_cpu_wait_limit(tiny_run: tuple[dict, str]) -> None:
    report, out = tiny_run
    latency = report["rounds"]["latency"]
    for r in latency:
        for arm, s in r.items():
            assert s["ok"] == s["requests"] == 40 and s["errors"] == 0, (arm, s)
            assert s["output_tokens"] == 40 * 8  # ignore_eos: exactly max_tokens each
            assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] < 30_000, (arm, s)
    for arm, prefix in (("pacer", "pacer"), ("sglang-router", "router")):
        timed = [r for r in latency if r[arm]["counted"] and r["direct"]["counted"]]
        assert report[f"{prefix}_latency_rounds_counted"] == len(timed)
        assert report[arm]["latency_rounds_counted"] == sum(r[arm]["counted"] for r in latency)
        added = sorted(r[arm]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"] for r in timed)
        if not timed:
            assert report[f"{prefix}_added_ttft_p50_ms"] is None and report[f"{prefix}_throughput_ratio"] is None
            assert f"  {arm:<14} no round timed (0 of {ROUNDS} rounds" in out
        else:
            median = (added[(len(added) - 1) // 2] + added[len(added) // 2]) / 2
            assert report[f"{prefix}_added_ttft_p50_ms"] == pytest.approx(median, abs=1e-3)
            assert 0.5 < report[f"{prefix}_throughput_ratio"] < 2.0  # every request got its whole answer
            assert f"  {arm:<14} added TTFT p50 " in out
        assert f"{len(timed)} of {ROUNDS} rounds; most waited per round: " in out


@pytest.mark.timeout(300)
def test_the_headline_is_cpu_per_request_and_chunks_per_cpu_second_of_each_proxy(tiny_run: tuple[dict, str]) -> None:
    report, out = tiny_run
    for arm, prefix in (("pacer", "pacer"), ("sglang-router", "router")):
        assert _finite(report[f"{prefix}_cpu_ms_per_request"]) and report[f"{prefix}_cpu_ms_per_request"] > 0
        assert _finite(report[f"{prefix}_chunks_per_cpu_s"]) and report[f"{prefix}_chunks_per_cpu_s"] > 0
        assert all(r[arm]["chunks_per_cpu_s"] > 0 and r[arm]["errors"] == 0 for r in report["rounds"]["stream"])
        assert f"  {arm:<14} {report[f'{prefix}_cpu_ms_per_request']:,.3f} ms CPU per request, " in out
    for key in ("pacer_per_router_cpu_per_request", "pacer_per_router_chunks_per_cpu_s"):
        assert _finite(report[key]) and report[key] > 0
    assert out.index("headline") < out.index("latency over direct")  # the headline comes first
    assert report["direct"]["chunks_per_cpu_s"] is None  # no proxy on that path


@pytest.mark.timeout(300)
def test_the_event_loops_of_the_client_worker_and_proxy_were_probed(tiny_run: tuple[dict, str]) -> None:
    report, out = tiny_run
    for s in (r["pacer"] for r in report["rounds"]["latency"]):
        assert {"client", "worker", "pacer"} <= set(s["loop_lag"])  # the router's (Rust) loop is not probed
        for lag in s["loop_lag"].values():
            assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
            assert set(lag["stalled_ms"]) == {"starved", "busy", "gc", "blocked"}
            assert lag["full_gc_passes"] >= 0 and (lag["full_gc_max_ms"] is None) is (lag["full_gc_passes"] == 0)
        tail = s["tail"]
        assert tail["requests"] >= 1 and tail["ttft_s"] > 0 and set(tail["stalled_s"]) == {"client", "worker", "pacer"}
        assert all(0 <= sum(k.values()) <= tail["ttft_s"] + 1e-3 for k in tail["stalled_s"].values())
    groups = report["pacer_loops"]
    assert groups and set(groups) <= {"counted", "starved"}
    assert sum(g["rounds"] for g in groups.values()) == ROUNDS
    assert "pacer arm, " in out and "    pacer          lag p99 " in out


@pytest.mark.timeout(300)
def test_the_proxy_and_router_share_a_cpu_of_their_own_and_every_process_is_stopped(tiny_run: tuple[dict, str]) -> None:
    report, _ = tiny_run
    if len(os.sched_getaffinity(0)) >= 2:
        pins = report["cpu_affinity"]  # read back from the processes of both phases, not the plan
        assert pins["pacer"] == pins["sglang-router"] and len(pins["pacer"]) == 1
        assert pins["worker"] == pins["client"] and not set(pins["pacer"]) & set(pins["worker"])
    procs = report["processes"]
    assert {p["name"] for p in procs} == {
        f"{tag}-{n}" for tag in ("latency", "stream") for n in ("sim", "pacer", "sglang-router")
    }
    wait_until_blocking(lambda: not [p for p in procs if _alive(p["pid"])], "every process gone")
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
