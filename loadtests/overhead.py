"""What does the proxy cost? ``python -m loadtests overhead [--report FILE.json]``

One fast ``pacer sim`` worker and three arms in front of it, real processes on loopback: ``direct``
(the client talks to the worker), ``pacer`` (through ``pacer serve``) and ``sglang-router`` (through
SGLang's router), each with limits far above the load. With 2+ CPUs the proxy under test (or the
router) has the last CPU to itself among these processes, the worker and the client share the
others, the same for every arm; the arms take turns, their order rotating every round.

The headline does not depend on how busy the machine is: the CPU per request of the proxy under
test (latency phase: ``--rate`` streamed requests per second, short answers) and its streamed
chunks per CPU-second (streaming phase: ``--stream-concurrency`` long streams back to back).
Latency (TTFT added over direct, p50 and p99: medians of per-round differences) and throughput
count only rounds in which no process on the path (client, worker, proxy) waited for a CPU
``STARVED_AT`` of the time or more (run-queue wait, from ``/proc``); every round prints it.

Each Python process runs an event-loop lag probe (``loadtests.loop_lag``): per round, how late each
loop ran and why (starved of CPU, its own work, the collector, a blocking call), and how much of the
slowest requests' TTFT (at or over the arm's p99) each loop spent stalled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.loadgen import Counter, Outcome, closed_loop, completion_body, open_loop, percentile, summarize
from loadtests.loop_lag import FLUSH_S, INTERVAL_S, Stall, probed, read_window, written_past
from loadtests.procs import Proc, cpu_seconds, runqueue_wait_seconds, start_pacer, start_router, start_sim

ARMS = ("direct", "pacer", "sglang-router")
MIDDLES = (("pacer", "pacer"), ("sglang-router", "router"))  # the proxied arms and their report prefix
PROMPT = "Summarize the following text in one paragraph. " * 8
STARVED_AT = 0.10  # a round where a process on the path waited for a CPU this much of the time is not timed
KINDS = ("starved", "busy", "gc", "blocked")  # what held an event loop (loop_lag.Stall.kind)

Usage = dict[str, tuple[float, float]]  # role -> (CPU seconds, run-queue wait seconds) so far
Rounds = list[dict[str, dict[str, Any]]]  # per round: arm -> figures


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def _order(rnd: int) -> list[str]:
    return [ARMS[(i + rnd) % len(ARMS)] for i in range(len(ARMS))]


def _path(arm: str) -> tuple[str, ...]:
    """The processes a request of ``arm`` goes through."""
    return ("client", "worker") if arm == "direct" else ("client", "worker", arm)


def _read_usage(procs: dict[str, Proc]) -> Usage:
    usage = {n: (p.cpu_seconds(), p.runqueue_wait_seconds()) for n, p in procs.items()}
    usage["client"] = (cpu_seconds(os.getpid()), runqueue_wait_seconds(os.getpid()))
    return usage


def usage_window(arm: str, before: Usage, after: Usage, wall_s: float) -> dict[str, Any]:
    """Each role's CPU (cores) and the fraction of ``wall_s`` its threads waited for a CPU; the role on
    the arm's path that waited most, and whether the round counts (it waited under ``STARVED_AT``)."""
    cores = {n: round((after[n][0] - before[n][0]) / wall_s, 3) for n in before}
    # a thread that ended between the two readings takes its wait with it: the sum can fall a little
    waited = {n: round(max(0.0, after[n][1] - before[n][1]) / wall_s, 3) for n in before}
    worst = max(_path(arm), key=lambda n: waited[n])
    return {
        "cpu_cores": cores,
        "cpu_wait_fraction": waited,
        "waited_most": [worst, waited[worst]],
        "counted": waited[worst] < STARVED_AT,
    }


def loop_lag(files: dict[str, Path], t0: float, t1: float) -> tuple[dict[str, Any], dict[str, list[Stall]]]:
    """Per role with a probe: its loop's lag from ``t0`` to ``t1`` (p50, p99, max; stalled ms by kind),
    and its stalls."""
    summary: dict[str, Any] = {}
    stalls: dict[str, list[Stall]] = {}
    for role, path in files.items():
        window = read_window(path, t0, t1)
        if window is None or not window.lags_ms:
            continue
        held = dict.fromkeys(KINDS, 0.0)
        for stall in window.stalls:
            held[stall.kind] += stall.lag_ms
        summary[role] = {
            "p50_ms": percentile(window.lags_ms, 50),
            "p99_ms": percentile(window.lags_ms, 99),
            "max_ms": max(window.lags_ms),
            "stalls": len(window.stalls),
            "stalled_ms": {k: round(v, 1) for k, v in held.items()},
            "gc_ms": round(window.gc_s * 1000, 1),
            "full_gc_passes": len(window.full_passes),
            "full_gc_max_ms": max((f[1] for f in window.full_passes), default=None),  # wall: starved ones run long
            "full_gc_cpu_max_ms": max((f[2] for f in window.full_passes), default=None),
            "full_gc_freed": sum(int(f[3]) for f in window.full_passes),
        }
        stalls[role] = window.stalls
    return summary, stalls


def tail_stalls(outcomes: Sequence[Outcome], stalls: dict[str, list[Stall]]) -> dict[str, Any] | None:
    """The slowest requests (TTFT at or over the p99): their summed TTFT, and how much of it each
    role's event loop was stalled, by kind (seconds)."""
    waits = [(o.sent, o.first) for o in outcomes if o.error is None and o.first is not None]
    if not waits:
        return None
    cut = percentile([first - sent for sent, first in waits], 99)
    tail = [(sent, first) for sent, first in waits if first - sent >= cut]
    covered = {role: dict.fromkeys(KINDS, 0.0) for role in stalls}
    for sent, first in tail:
        for role, found in stalls.items():
            for stall in found:
                overlap = min(first, stall.end) - max(sent, stall.start)
                if overlap > 0:
                    covered[role][stall.kind] += overlap
    return {
        "requests": len(tail),
        "ttft_from_ms": round(cut * 1000, 3),
        "ttft_s": round(sum(first - sent for sent, first in tail), 4),
        "stalled_s": {role: {k: round(v, 4) for k, v in kinds.items()} for role, kinds in covered.items()},
    }


@dataclass(frozen=True)
class Bench:
    """One phase's processes: each arm's URL, the processes by role, and each probed event loop's file."""

    urls: dict[str, str]
    procs: dict[str, Proc]
    lag_files: dict[str, Path]


async def _after_window(bench: Bench, arm: str, before: Usage, t0: float) -> tuple[dict[str, Any], float]:
    """The usage since ``before`` (at ``t0``), once the probes have written the window's last lines (at
    most ``2 * FLUSH_S`` later: a probe held back longer is read as far as it got)."""
    after, t1 = _read_usage(bench.procs), time.perf_counter()
    files = list(bench.lag_files.values())
    while time.perf_counter() < t1 + 2 * FLUSH_S and not all(written_past(f, t1) for f in files):
        await asyncio.sleep(INTERVAL_S)
    return usage_window(arm, before, after, t1 - t0), t1


async def _latency_arm(bench: Bench, arm: str, body: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    url = bench.urls[arm] + "/v1/completions"
    await open_loop(url, body, rate=args.rate, duration_s=args.warmup)  # connections and caches warm
    gc.collect()
    gc.freeze()  # the client's own full collections would add pauses to every arm's TTFT
    before, t0 = _read_usage(bench.procs), time.perf_counter()
    res = await open_loop(url, body, rate=args.rate, duration_s=args.duration)
    usage, t1 = await _after_window(bench, arm, before, t0)
    s = summarize(res)
    s.update(usage)
    s["loop_lag"], stalls = loop_lag(bench.lag_files, t0, t1)
    s["tail"] = tail_stalls(res.outcomes, {role: found for role, found in stalls.items() if role in _path(arm)})
    s["wall_s"] = round(t1 - t0, 3)
    s["load_average_1m"] = round(os.getloadavg()[0], 2)
    return s


async def _stream_arm(bench: Bench, arm: str, body: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    counter, stop = Counter(), asyncio.Event()
    url = bench.urls[arm] + "/v1/completions"
    task = asyncio.create_task(closed_loop(url, body, concurrency=args.stream_concurrency, stop=stop, counter=counter))
    await asyncio.sleep(args.stream_warmup)
    c0, k0, r0 = counter.chunks, counter.tokens, counter.reads
    before, t0 = _read_usage(bench.procs), time.perf_counter()
    await asyncio.sleep(args.stream_window)
    c1, k1, r1 = counter.chunks, counter.tokens, counter.reads
    usage, t1 = await _after_window(bench, arm, before, t0)
    stop.set()
    res = await task
    dt, chunks = t1 - t0, c1 - c0
    errors = [o.error for o in res.outcomes if o.error is not None]  # requests cut by the stop are not listed
    middle_cpu_s = usage["cpu_cores"][arm] * dt if arm in bench.procs else None
    s: dict[str, Any] = {
        "chunks": chunks,
        "chunks_per_s": round(chunks / dt, 1),
        "stream_tok_per_s": round((k1 - k0) / dt, 1),
        "chunks_per_read": round(chunks / max(1, r1 - r0), 2),
        "chunks_per_cpu_s": round(chunks / middle_cpu_s, 1) if middle_cpu_s else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        **usage,
        "wall_s": round(dt, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    s["loop_lag"], _ = loop_lag(bench.lag_files, t0, t1)
    return s


def _num(v: float | None, decimals: int) -> str:
    return "-" if v is None else f"{v:,.{decimals}f}"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f} %" if fraction < 0.1 else f"{fraction * 100:.0f} %"


def waited_text(s: dict[str, Any], arm: str) -> str:
    """``waited for a CPU: client 3.1 %, worker 2.0 %, pacer 0.4 %: counted`` (or ``STARVED``)."""
    w = s["cpu_wait_fraction"]
    parts = ", ".join(f"{n} {_pct(w[n])}" for n in _path(arm))
    verdict = "counted" if s["counted"] else f"STARVED ({s['waited_most'][0]}), not counted"
    return f"waited for a CPU: {parts}: {verdict}"


def lag_text(s: dict[str, Any]) -> str:
    """Each probed loop's lag p99 / max, and what its stalls (>= 5 ms) were, in ms."""
    parts = []
    for role, v in s["loop_lag"].items():
        held = ", ".join(f"{k} {ms:,.0f}" for k, ms in v["stalled_ms"].items() if ms >= 0.5)
        full = (
            f"; {v['full_gc_passes']} full GC, up to {v['full_gc_max_ms']:,.0f} ms ({v['full_gc_cpu_max_ms']:,.0f} CPU)"
            if v["full_gc_passes"]
            else ""
        )
        parts.append(
            f"{role} {v['p99_ms']:.1f} / {v['max_ms']:,.0f}" + (f" (stalled ms: {held}{full})" if held or full else "")
        )
    return "loop lag p99 / max ms: " + "; ".join(parts) if parts else ""


def tail_text(s: dict[str, Any]) -> str:
    """How much of the slowest requests' TTFT each loop on the path spent stalled, and mostly why."""
    t = s.get("tail")
    if not t or not t["ttft_s"]:
        return ""
    parts = []
    for role, kinds in t["stalled_s"].items():
        total = sum(kinds.values())
        why = f" ({max(kinds, key=lambda k: kinds[k])})" if total else ""
        parts.append(f"{role} {_pct(total / t['ttft_s'])}{why}")
    return f"slowest {t['requests']} (TTFT >= {t['ttft_from_ms']:,.1f} ms): stalled loops held " + ", ".join(parts)


def _say_arm(say: Callable[[str], None], phase: str, rnd: int, arm: str, s: dict[str, Any]) -> None:
    if phase == "latency":
        cpu = (
            f", {s['cpu_cores'][arm] * s['wall_s'] * 1000 / s['requests']:.3f} ms CPU/request"
            if arm != "direct"
            else ""
        )
        what = f"TTFT p50 {s['ttft_p50_ms']} ms, p99 {s['ttft_p99_ms']} ms, ok {s['ok']}/{s['requests']}{cpu}"
    else:
        per_cpu = f", {s['chunks_per_cpu_s']:,.0f} chunks per CPU-s" if s["chunks_per_cpu_s"] else ""
        what = f"{s['chunks_per_s']:,.0f} chunks/s{per_cpu} ({s['chunks_per_read']} per read)"
    say(f"  round {rnd + 1} {phase:<8} {arm:<14} {what}; {waited_text(s, arm)}")
    for extra in (lag_text(s), tail_text(s) if phase == "latency" else ""):
        if extra:
            say(f"      {extra}")


async def _rounds(
    bench: Bench, phase: str, body: dict[str, Any], args: argparse.Namespace, say: Callable[[str], None]
) -> Rounds:
    arm_run = _latency_arm if phase == "latency" else _stream_arm
    rounds: Rounds = []
    for rnd in range(args.rounds):
        out: dict[str, dict[str, Any]] = {}
        for arm in _order(rnd):
            out[arm] = await arm_run(bench, arm, body, args)
            _say_arm(say, phase, rnd, arm, out[arm])
        rounds.append(out)
    return rounds


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def _paired(rounds: Rounds, arm: str) -> Rounds:
    """The rounds in which both ``arm`` and ``direct`` were counted (neither path starved)."""
    return [r for r in rounds if r[arm]["counted"] and r["direct"]["counted"]]


def _arm_figures(latency: Rounds, stream: Rounds, arm: str) -> dict[str, Any]:
    lat = [r[arm] for r in latency if r[arm]["counted"]]
    st = [r[arm] for r in stream if r[arm]["counted"]]
    return {
        "ttft_p50_ms": _median([s["ttft_p50_ms"] for s in lat]),
        "ttft_p99_ms": _median([s["ttft_p99_ms"] for s in lat]),
        "output_tok_per_s": _median([s["output_tok_per_s"] for s in lat]),
        "chunks_per_s": _median([s["chunks_per_s"] for s in st]),
        "stream_tok_per_s": _median([s["stream_tok_per_s"] for s in st]),
        "latency_rounds_counted": len(lat),
        "stream_rounds_counted": len(st),
        # these two do not depend on the machine being quiet: every round
        "chunks_per_cpu_s": _median([r[arm]["chunks_per_cpu_s"] for r in stream]),
        "chunks_per_read": _median([r[arm]["chunks_per_read"] for r in stream]),
        "client_send_lag_p99_ms": _median([r[arm]["client_send_lag_p99_ms"] for r in latency]),
        "waited_most": [r[arm]["waited_most"] for r in latency],
        "errors": sum(r[arm]["errors"] for r in latency) + sum(r[arm]["errors"] for r in stream),
    }


def loop_findings(latency: Rounds, arm: str) -> dict[str, Any]:
    """The event loops on ``arm``'s path over its latency rounds, counted and starved rounds apart: per
    role, the median p99 and the max lag, stalled ms per second by kind, and the share of the slowest
    requests' TTFT that role's loop spent stalled, by kind."""
    out: dict[str, Any] = {}
    for group, counted in (("counted", True), ("starved", False)):
        rounds = [r[arm] for r in latency if r[arm]["counted"] is counted]
        tails = [s["tail"] for s in rounds if s.get("tail") and s["tail"]["ttft_s"]]
        ttft_s = sum(t["ttft_s"] for t in tails)
        roles: dict[str, Any] = {}
        for role in _path(arm):
            lags = [(s["loop_lag"][role], s["wall_s"]) for s in rounds if role in s["loop_lag"]]
            if not lags:
                continue
            wall = sum(w for _, w in lags)
            held = [t["stalled_s"][role] for t in tails if role in t["stalled_s"]]
            roles[role] = {
                "lag_p99_ms": _median([v["p99_ms"] for v, _ in lags]),
                "lag_max_ms": max(v["max_ms"] for v, _ in lags),
                "stalled_ms_per_s": {k: round(sum(v["stalled_ms"][k] for v, _ in lags) / wall, 2) for k in KINDS},
                "tail_ttft_share": {k: round(sum(h[k] for h in held) / ttft_s, 3) for k in KINDS} if held else None,
                "full_gc_passes": sum(v["full_gc_passes"] for v, _ in lags),
                "full_gc_max_ms": max((v["full_gc_max_ms"] for v, _ in lags if v["full_gc_max_ms"]), default=None),
                "full_gc_cpu_max_ms": max(
                    (v["full_gc_cpu_max_ms"] for v, _ in lags if v["full_gc_cpu_max_ms"]), default=None
                ),
            }
        if roles:
            out[group] = {"rounds": len(rounds), "tail_requests": sum(t["requests"] for t in tails), "loops": roles}
    return out


def aggregate(latency: Rounds, stream: Rounds) -> dict[str, Any]:
    """The report. The headline (CPU per request, chunks per CPU-second of the proxy under test) is the
    median over every round; latency and throughput count only rounds whose path was not starved, the
    added TTFT and the ratios as medians of per-round differences / ratios against direct (paired)."""
    report: dict[str, Any] = {"starved_at": STARVED_AT}
    for arm in ARMS:
        report[arm] = _arm_figures(latency, stream, arm)
    for arm, prefix in MIDDLES:
        pairs, stream_pairs = _paired(latency, arm), _paired(stream, arm)
        for q in ("p50", "p99"):
            report[f"{prefix}_added_ttft_{q}_ms"] = _median(
                [r[arm][f"ttft_{q}_ms"] - r["direct"][f"ttft_{q}_ms"] for r in pairs
                 if r[arm][f"ttft_{q}_ms"] is not None and r["direct"][f"ttft_{q}_ms"] is not None]
            )  # fmt: skip
        report[f"{prefix}_throughput_ratio"] = _median(
            [
                r[arm]["output_tok_per_s"] / r["direct"]["output_tok_per_s"]
                for r in pairs
                if r["direct"]["output_tok_per_s"]
            ]
        )
        report[f"{prefix}_stream_throughput_ratio"] = _median(
            [
                r[arm]["stream_tok_per_s"] / r["direct"]["stream_tok_per_s"]
                for r in stream_pairs
                if r["direct"]["stream_tok_per_s"]
            ]
        )
        report[f"{prefix}_latency_rounds_counted"] = len(pairs)
        report[f"{prefix}_cpu_ms_per_request"] = _median(
            [
                r[arm]["cpu_cores"][arm] * r[arm]["wall_s"] * 1000 / r[arm]["requests"]
                for r in latency
                if r[arm]["requests"]
            ]
        )
        report[f"{prefix}_chunks_per_cpu_s"] = report[arm]["chunks_per_cpu_s"]
        report[f"{prefix}_cpu_cores"] = _median([r[arm]["cpu_cores"][arm] for r in latency])
        report[f"{prefix}_cpu_wait_fraction"] = _median([r[arm]["cpu_wait_fraction"][arm] for r in latency])
        report[f"{prefix}_loops"] = loop_findings(latency, arm)
    p, r = report["pacer_cpu_ms_per_request"], report["router_cpu_ms_per_request"]
    report["pacer_per_router_cpu_per_request"] = round(p / r, 3) if p and r else None
    p, r = report["pacer_chunks_per_cpu_s"], report["router_chunks_per_cpu_s"]
    report["pacer_per_router_chunks_per_cpu_s"] = round(p / r, 3) if p and r else None
    report["load_average_1m_median"] = _median([s["load_average_1m"] for r in latency + stream for s in r.values()])
    report["rounds"] = {"latency": latency, "stream": stream}
    return report


def table(report: dict[str, Any]) -> str:
    """Per arm: latency and throughput from the rounds counted (how many), and chunks per CPU-s."""

    def f(v: Any, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else f"{v:,}")

    rows = [
        "| arm | rounds timed | TTFT p50 ms | TTFT p99 ms | added p50 / p99 ms | output tok/s (ratio) "
        "| stream chunks/s | chunks per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, prefix in (("direct", None), *MIDDLES):
        a = report[arm]
        add = (
            "-"
            if prefix is None
            else f"{f(report[f'{prefix}_added_ttft_p50_ms'])} / {f(report[f'{prefix}_added_ttft_p99_ms'])}"
        )
        tput = f(a["output_tok_per_s"], 0) + (
            "" if prefix is None else f" ({f(report[f'{prefix}_throughput_ratio'], 3)})"
        )
        timed = f"{a['latency_rounds_counted']} of {len(a['waited_most'])}"
        rows.append(
            f"| {arm} | {timed} | {f(a['ttft_p50_ms'])} | {f(a['ttft_p99_ms'])} | {add} | {tput} "
            f"| {f(a['chunks_per_s'], 0)} | {f(a['chunks_per_cpu_s'], 0)} |"
        )
    return "\n".join(rows)


def _latency_line(report: dict[str, Any], arm: str, prefix: str) -> str:
    waits = []
    for r in report["rounds"]["latency"]:
        role, frac = max((r[arm]["waited_most"], r["direct"]["waited_most"]), key=lambda w: w[1])
        waits.append(_pct(frac) + ("" if frac < STARVED_AT else f" starved ({role})"))
    rounds = f"{report[f'{prefix}_latency_rounds_counted']} of {len(waits)} rounds; most waited per round: {', '.join(waits)}"
    if not report[f"{prefix}_latency_rounds_counted"]:
        return f"  {arm:<14} no round timed ({rounds})"
    return (
        f"  {arm:<14} added TTFT p50 {report[f'{prefix}_added_ttft_p50_ms']} ms, p99 "
        f"{report[f'{prefix}_added_ttft_p99_ms']} ms, throughput x{report[f'{prefix}_throughput_ratio']} ({rounds})"
    )


def _kinds_text(by_kind: dict[str, float], fmt: Callable[[float], str]) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in by_kind.items() if v) or "none"


def _loops_lines(report: dict[str, Any], arm: str, prefix: str) -> list[str]:
    lines = []
    for group, found in report[f"{prefix}_loops"].items():
        lines.append(f"  {arm} arm, {group} rounds ({found['rounds']}), slowest {found['tail_requests']} requests:")
        for role, v in found["loops"].items():
            stalled = sum(v["stalled_ms_per_s"].values())
            share = v["tail_ttft_share"] or {}
            lines.append(
                f"    {role:<14} lag p99 {v['lag_p99_ms']:,.1f} ms, max {v['lag_max_ms']:,.0f} ms; stalled "
                f"{stalled:,.1f} ms/s ({_kinds_text(v['stalled_ms_per_s'], lambda x: f'{x:,.1f}')}); "
                f"stalled through {_pct(sum(share.values()))} of their TTFT ({_kinds_text(share, _pct)})"
                + (
                    f"; {v['full_gc_passes']} full GC passes, up to {v['full_gc_max_ms']:,.0f} ms "
                    f"({v['full_gc_cpu_max_ms']:,.0f} ms CPU)"
                    if v["full_gc_passes"]
                    else ""
                )
            )
    return lines


def summary(report: dict[str, Any]) -> list[str]:
    """The printed conclusion: the headline, then latency from the rounds timed, then the event loops."""
    lines = ["headline (the proxy under test, every round; these do not depend on how busy the machine was):"]
    for arm, prefix in MIDDLES:
        lines.append(
            f"  {arm:<14} {_num(report[f'{prefix}_cpu_ms_per_request'], 3)} ms CPU per request, "
            f"{_num(report[f'{prefix}_chunks_per_cpu_s'], 0)} streamed chunks per CPU-second"
        )
    lines.append(
        f"  pacer / router: CPU per request x{report['pacer_per_router_cpu_per_request']}, "
        f"chunks per CPU-second x{report['pacer_per_router_chunks_per_cpu_s']}"
    )
    lines.append(
        f"latency over direct, only from rounds where every process on both paths waited for a CPU "
        f"< {_pct(STARVED_AT)} of the time:"
    )
    lines += [_latency_line(report, arm, prefix) for arm, prefix in MIDDLES]
    lines.append("event loops (stalls: wake-ups 5 ms late or more, by what held the loop; the slowest: TTFT >= p99):")
    for arm, prefix in MIDDLES:
        lines += _loops_lines(report, arm, prefix)
    return lines


@contextlib.contextmanager
def _arms(
    logs: Path,
    time_scale: float,
    args: argparse.Namespace,
    tag: str,
    pins: dict[str, frozenset[int]],
    started: list[dict[str, Any]],
) -> Iterator[Bench]:
    """One worker, and pacer and sglang-router in front of it, on the CPUs ``pins`` gives (planned before
    the client pinned itself). Each process is listed in ``started`` (name, pid, ports, the CPUs it may
    run on, read back) and stopped on the way out."""
    probe = args.loop_lag
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(
            start_sim(
                logs,
                time_scale=time_scale,
                name=f"{tag}-sim",
                cpus=pins.get("worker"),
                extra=["--max-running-requests", str(args.max_running)],
                lag_file=logs / f"{tag}-sim-lag.jsonl" if probe else None,
            )
        )
        pacer = stack.enter_context(
            start_pacer(
                logs,
                [sim.url],
                name=f"{tag}-pacer",
                cpus=pins.get("middle"),
                lag_file=logs / f"{tag}-pacer-lag.jsonl" if probe else None,
            )
        )
        router = stack.enter_context(
            start_router(
                logs,
                sim.url,
                max_concurrent=args.router_max_concurrent,
                queue_size=args.router_queue_size,
                name=f"{tag}-sglang-router",
                cpus=pins.get("middle"),
            )
        )
        procs = {"worker": sim, "pacer": pacer, "sglang-router": router}
        started.extend(
            {
                "name": p.name,
                "role": n,
                "pid": p.pid,
                "ports": list(p.ports),
                "cpus": sorted(os.sched_getaffinity(p.pid)),
            }
            for n, p in procs.items()
        )
        check_pinned({n: os.sched_getaffinity(p.pid) for n, p in procs.items()}, pins)
        lag_files = {n: p.lag_file for n, p in procs.items() if p.lag_file is not None}
        if probe:
            lag_files["client"] = logs / f"{tag}-client-lag.jsonl"
            lag_files["client"].unlink(missing_ok=True)
        yield Bench({"direct": sim.url, "pacer": pacer.url, "sglang-router": router.url}, procs, lag_files)
        for p in procs.values():
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} died during the benchmark:\n{p.log_tail()}")


def cpu_plan(pin: bool, cpus: frozenset[int] | None = None) -> dict[str, frozenset[int]]:
    """Which of ``cpus`` (this process's, by default) each role may use: with ``pin`` and at least two,
    the proxy (or the router; only one of them carries traffic at a time) gets the last CPU to itself
    among the benchmark's processes, and the worker and the client share the others. Empty without
    pinning (the OS places everything). Plan once, before the client pins itself: asked again after,
    the client's one CPU would be all there is."""
    ordered = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not pin or len(ordered) < 2:
        return {}
    rest = frozenset(ordered[:-1])
    return {"middle": frozenset(ordered[-1:]), "worker": rest, "client": rest}


def check_pinned(actual: dict[str, set[int]], pins: dict[str, frozenset[int]]) -> None:
    """Raise unless each process (by role) may run on exactly the CPUs planned for it."""
    if not pins:
        return
    planned = {role: pins["worker" if role == "worker" else "middle"] for role in actual}
    wrong = {role: sorted(cpus) for role, cpus in actual.items() if set(cpus) != set(planned[role])}
    if wrong:
        raise RuntimeError(f"processes not on their planned CPUs: {wrong}, planned {_pins_text(pins)}")


@contextlib.contextmanager
def _client_pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process (the client) on ``cpus`` for the duration; its own affinity back after."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _loop_run(coro: Coroutine[Any, Any, Any], lag_file: Path | None = None) -> Any:
    """Run ``coro`` on uvloop (asyncio without it), with the lag probe on when ``lag_file`` is given."""
    main = probed(coro, lag_file) if lag_file is not None else coro
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Both phases, each with its own worker, proxy and router (all stopped after); returns the report."""
    started: list[dict[str, Any]] = []
    pins = cpu_plan(args.pin)
    phases: dict[str, Rounds] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_client_pinned(pins.get("client")))
        client_cpus = sorted(os.sched_getaffinity(0))
        logs = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for phase, scale, output_len in (
            ("latency", args.time_scale, args.output_len),
            ("stream", args.stream_time_scale, args.stream_output_len),
        ):
            with _arms(logs, scale, args, phase, pins, started) as bench:
                body = completion_body(_model(bench.urls["direct"]), PROMPT, output_len)
                say(
                    f"{phase} phase: worker x{scale:g}, "
                    + (f"{args.rate:g} requests/s, " if phase == "latency" else f"{args.stream_concurrency} streams, ")
                    + f"{output_len} tokens each; CPUs {_pins_text(pins)}; load average {os.getloadavg()[0]:.2f}"
                )
                phases[phase] = _loop_run(_rounds(bench, phase, body, args, say), bench.lag_files.get("client"))
    report = aggregate(phases["latency"], phases["stream"])
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("report", "log_dir")}
    report["cpu_count"] = os.cpu_count()
    report["cpu_affinity"] = affinity_by_role(started, client_cpus) if pins else None
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    report["processes"] = started  # all stopped by now
    return report


def affinity_by_role(started: list[dict[str, Any]], client_cpus: list[int]) -> dict[str, list[int]]:
    """The CPUs each role may run on, read back from its processes (both phases together) and the client."""
    by_role: dict[str, set[int]] = {"client": set(client_cpus)}
    for p in started:
        by_role.setdefault(p["role"], set()).update(p["cpus"])
    return {role: sorted(cpus) for role, cpus in by_role.items()}


def _pins_text(pins: dict[str, frozenset[int]]) -> str:
    if not pins:
        return "not pinned"
    return f"proxy under test {sorted(pins['middle'])}, worker and client {sorted(pins['worker'])}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests overhead", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--report", type=Path, default=None, help="write the figures as JSON here")
    a("--rate", type=float, default=200.0, help="requests per second in the latency phase")
    a("--duration", type=float, default=10.0, help="seconds of arrivals per arm and round (latency phase)")
    a("--warmup", type=float, default=1.0, help="seconds of arrivals before each measured run (not counted)")
    a("--output-len", type=int, default=16, help="output tokens per request in the latency phase")
    a("--rounds", type=int, default=3)
    a("--stream-concurrency", type=int, default=256)
    a("--stream-output-len", type=int, default=4000)
    a("--stream-warmup", type=float, default=2.0)
    a("--stream-window", type=float, default=8.0)
    a(
        "--time-scale",
        type=float,
        default=100.0,
        help="latency phase: the worker runs this many times faster than the modelled GPU",
    )
    a(
        "--stream-time-scale",
        type=float,
        default=2.0,
        help="streaming phase: slow enough that each stream gets one token per step (as from a real server), "
        "so chunks mostly arrive one per read instead of coalesced",
    )
    a("--max-running", type=int, default=1024, help="the worker's --max-running-requests")
    a("--router-max-concurrent", type=int, default=1024, help="sglang-router --max-concurrent-requests")
    a("--router-queue-size", type=int, default=4096, help="sglang-router --queue-size")
    a("--log-dir", default=None, help="keep the processes' logs here (default: a temporary folder)")
    a(
        "--max-load",
        type=float,
        default=None,
        help="on a shared machine: first wait (up to --max-wait s) until the 1-minute load average is below this",
    )
    a("--max-wait", type=float, default=600.0)
    a(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin the proxy (and the router) to one CPU and the worker and client to the others "
        "(needs 2+ CPUs; other programs on the machine are not moved)",
    )
    a(
        "--loop-lag",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="probe the event loops of the client, the worker and pacer serve (loadtests.loop_lag)",
    )
    return p


def wait_for_load(max_load: float, max_wait_s: float) -> float:
    """Sleep until the 1-minute load average is below ``max_load`` or ``max_wait_s`` passed; seconds waited."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < max_wait_s:
        time.sleep(5)
    return time.monotonic() - t0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_load is not None:
        waited = wait_for_load(args.max_load, args.max_wait)
        print(
            f"waited {waited:.0f} s for the load average to drop below {args.max_load:g}: now {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    report = run(args, lambda line: print(line, flush=True))
    print()
    print(table(report))
    print()
    print("\n".join(summary(report)))
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
