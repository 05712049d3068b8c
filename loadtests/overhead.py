"""What does the proxy cost? ``python -m loadtests overhead [--report FILE.json]``

One fast ``pacer sim`` worker and three arms in front of it, all real processes on loopback:

    direct         the client talks to the worker
    pacer          through ``pacer serve`` (policy kind = "external" naming that same worker; a
                   pacing band far above the load, so the gate never holds a request back)
    sglang-router  through SGLang's router (``sglang-router``) with its concurrency limit and queue

Two phases, each run in ``--rounds`` rounds with the arms interleaved (their order rotates every
round) so that a busy machine hurts them alike; figures are medians over rounds, and the added
latency and throughput ratio are medians of the per-round differences and ratios:

1. **latency**: an open-loop schedule of ``--rate`` streamed ``/v1/completions`` requests per second
   for ``--duration`` seconds (short answers): TTFT p50/p99 (sent to first content chunk) and
   output tokens per second (first send to last end).
2. **streaming**: ``--stream-concurrency`` clients back to back, long answers: chunks per second at
   the client, and chunks relayed per CPU second of the proxy (or router) process, read from
   ``/proc`` over the same window (``chunks_per_cpu_s``: streamed chunks per second on one core).

The worker runs ``--time-scale`` times faster than the modelled H100, so its steps take micro-
seconds and the TTFT it adds is its own request handling. The client runs in this process; its CPU
use and how late it sent requests are reported, so a client that fell behind shows.
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtests.loadgen import Counter, closed_loop, completion_body, open_loop, summarize
from loadtests.procs import Proc, runqueue_wait_seconds, start_pacer, start_router, start_sim

ARMS = ("direct", "pacer", "sglang-router")
PROMPT = "Summarize the following text in one paragraph. " * 8


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def _order(rnd: int) -> list[str]:
    return [ARMS[(i + rnd) % len(ARMS)] for i in range(len(ARMS))]


async def _latency_round(
    urls: dict[str, str],
    procs: dict[str, Proc],
    body: dict[str, Any],
    rnd: int,
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in _order(rnd):
        url = urls[arm] + "/v1/completions"
        await open_loop(url, body, rate=args.rate, duration_s=args.warmup)  # connections and caches warm
        gc.collect()
        gc.freeze()  # the client's own full collections would add pauses to every arm's TTFT
        cpu0 = {n: p.cpu_seconds() for n, p in procs.items()}
        wait0 = {n: p.runqueue_wait_seconds() for n, p in procs.items()}
        own0 = runqueue_wait_seconds(os.getpid())
        res = await open_loop(url, body, rate=args.rate, duration_s=args.duration)
        s = summarize(res)
        for n, p in procs.items():
            s[f"{n}_cpu_cores"] = round((p.cpu_seconds() - cpu0[n]) / res.wall_s, 3)
            s[f"{n}_cpu_wait_fraction"] = round((p.runqueue_wait_seconds() - wait0[n]) / res.wall_s, 3)
        s["client_cpu_wait_fraction"] = round((runqueue_wait_seconds(os.getpid()) - own0) / res.wall_s, 3)
        s["load_average_1m"] = round(os.getloadavg()[0], 2)
        s["wall_s"] = round(res.wall_s, 3)
        out[arm] = s
        say(
            f"  round {rnd + 1} latency  {arm:<14} TTFT p50 {s['ttft_p50_ms']} ms, p99 {s['ttft_p99_ms']} ms, "
            f"{s['output_tok_per_s']} tok/s, ok {s['ok']}/{s['requests']}, client lag p99 "
            f"{s['client_send_lag_p99_ms']} ms, client {s['client_cpu_cores']} cores"
        )
    return out


async def _stream_round(
    urls: dict[str, str],
    procs: dict[str, Proc],
    body: dict[str, Any],
    rnd: int,
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in _order(rnd):
        counter, stop = Counter(), asyncio.Event()
        task = asyncio.create_task(
            closed_loop(
                urls[arm] + "/v1/completions", body, concurrency=args.stream_concurrency, stop=stop, counter=counter
            )
        )
        await asyncio.sleep(args.stream_warmup)
        middle = procs.get(arm)
        c0, k0, r0, t0 = counter.chunks, counter.tokens, counter.reads, time.perf_counter()
        m0, w0, p0 = (middle.cpu_seconds() if middle else 0.0), procs["worker"].cpu_seconds(), time.process_time()
        await asyncio.sleep(args.stream_window)
        c1, k1, r1, t1 = counter.chunks, counter.tokens, counter.reads, time.perf_counter()
        m1, w1, p1 = (middle.cpu_seconds() if middle else 0.0), procs["worker"].cpu_seconds(), time.process_time()
        stop.set()
        res = await task
        dt, chunks = t1 - t0, c1 - c0
        errors = [o.error for o in res.outcomes if o.error is not None]  # requests cut by the stop are not listed
        s: dict[str, Any] = {
            "chunks": chunks,
            "chunks_per_s": round(chunks / dt, 1),
            "stream_tok_per_s": round((k1 - k0) / dt, 1),
            "chunks_per_read": round(chunks / max(1, r1 - r0), 2),
            "chunks_per_cpu_s": round(chunks / (m1 - m0), 1) if middle and m1 > m0 else None,
            "middle_cpu_cores": round((m1 - m0) / dt, 3) if middle else None,
            "worker_cpu_cores": round((w1 - w0) / dt, 3),
            "client_cpu_cores": round((p1 - p0) / dt, 3),
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
        out[arm] = s
        per_core = f", {s['chunks_per_cpu_s']} chunks per {arm} CPU-s" if middle else ""
        say(
            f"  round {rnd + 1} stream   {arm:<14} {s['chunks_per_s']} chunks/s{per_core} "
            f"({s['chunks_per_read']} per read; worker {s['worker_cpu_cores']} cores, client {s['client_cpu_cores']} cores)"
        )
    return out


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def aggregate(latency: list[dict[str, dict[str, Any]]], stream: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The report: per arm medians over rounds, and the pacer's added TTFT and throughput ratio as
    medians of per-round differences / ratios against direct (paired, so slow rounds cancel)."""
    report: dict[str, Any] = {}
    for arm in ARMS:
        report[arm] = {
            "ttft_p50_ms": _median([r[arm]["ttft_p50_ms"] for r in latency]),
            "ttft_p99_ms": _median([r[arm]["ttft_p99_ms"] for r in latency]),
            "output_tok_per_s": _median([r[arm]["output_tok_per_s"] for r in latency]),
            "chunks_per_s": _median([r[arm]["chunks_per_s"] for r in stream]),
            "chunks_per_cpu_s": _median([r[arm]["chunks_per_cpu_s"] for r in stream]),
            "stream_tok_per_s": _median([r[arm]["stream_tok_per_s"] for r in stream]),
            "chunks_per_read": _median([r[arm]["chunks_per_read"] for r in stream]),
            "client_send_lag_p99_ms": _median([r[arm]["client_send_lag_p99_ms"] for r in latency]),
            "client_cpu_wait_fraction": _median([r[arm]["client_cpu_wait_fraction"] for r in latency]),
            "errors": sum(r[arm]["errors"] for r in latency) + sum(r[arm]["errors"] for r in stream),
        }

    def added(arm: str, key: str) -> float | None:
        return _median(
            [
                r[arm][key] - r["direct"][key]
                for r in latency
                if r[arm][key] is not None and r["direct"][key] is not None
            ]
        )

    def ratio(rounds: list[dict[str, dict[str, Any]]], arm: str, key: str) -> float | None:
        return _median([r[arm][key] / r["direct"][key] for r in rounds if r["direct"][key]])

    for arm, prefix in (("pacer", "pacer"), ("sglang-router", "router")):
        report[f"{prefix}_added_ttft_p50_ms"] = added(arm, "ttft_p50_ms")
        report[f"{prefix}_added_ttft_p99_ms"] = added(arm, "ttft_p99_ms")
        report[f"{prefix}_throughput_ratio"] = ratio(latency, arm, "output_tok_per_s")
        report[f"{prefix}_stream_throughput_ratio"] = ratio(stream, arm, "stream_tok_per_s")
    for arm, prefix in (("pacer", "pacer"), ("sglang-router", "router")):  # while its own arm runs
        report[f"{prefix}_cpu_cores"] = _median([r[arm][f"{arm}_cpu_cores"] for r in latency])
        report[f"{prefix}_cpu_wait_fraction"] = _median([r[arm][f"{arm}_cpu_wait_fraction"] for r in latency])
        report[f"{prefix}_cpu_ms_per_request"] = _median(
            [
                r[arm][f"{arm}_cpu_cores"] * r[arm]["wall_s"] * 1000 / r[arm]["requests"]
                for r in latency
                if r[arm]["requests"]
            ]
        )
    report["pacer_chunks_per_cpu_s"] = report["pacer"]["chunks_per_cpu_s"]
    report["router_chunks_per_cpu_s"] = report["sglang-router"]["chunks_per_cpu_s"]
    report["load_average_1m_median"] = _median([s["load_average_1m"] for r in latency + stream for s in r.values()])
    report["rounds"] = {"latency": latency, "stream": stream}
    return report


def table(report: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else f"{v:,}")

    rows = [
        "| arm | TTFT p50 ms | TTFT p99 ms | added p50 / p99 ms | output tok/s (ratio) "
        "| stream chunks/s | chunks per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, prefix in (("direct", None), ("pacer", "pacer"), ("sglang-router", "router")):
        a = report[arm]
        add = (
            "-"
            if prefix is None
            else f"{f(report[f'{prefix}_added_ttft_p50_ms'])} / {f(report[f'{prefix}_added_ttft_p99_ms'])}"
        )
        tput = f(a["output_tok_per_s"], 0) + (
            "" if prefix is None else f" ({f(report[f'{prefix}_throughput_ratio'], 3)})"
        )
        rows.append(
            f"| {arm} | {f(a['ttft_p50_ms'])} | {f(a['ttft_p99_ms'])} | {add} | {tput} "
            f"| {f(a['chunks_per_s'], 0)} | {f(a['chunks_per_cpu_s'], 0)} |"
        )
    return "\n".join(rows)


@contextlib.contextmanager
def _arms(
    logs: Path, time_scale: float, args: argparse.Namespace, tag: str, started: list[dict[str, Any]]
) -> Iterator[tuple[dict[str, str], dict[str, Proc]]]:
    """One worker, and pacer and sglang-router in front of it: (urls by arm, processes by role).
    Each process is listed in ``started`` (name, pid, ports) and stopped on the way out."""
    with contextlib.ExitStack() as stack:
        pins = cpu_plan(args.pin)
        sim = stack.enter_context(
            start_sim(
                logs,
                time_scale=time_scale,
                name=f"{tag}-sim",
                cpus=pins.get("worker"),
                extra=["--max-running-requests", str(args.max_running)],
            )
        )
        pacer = stack.enter_context(start_pacer(logs, [sim.url], name=f"{tag}-pacer", cpus=pins.get("middle")))
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
        started.extend({"name": p.name, "pid": p.pid, "ports": list(p.ports)} for p in procs.values())
        yield {"direct": sim.url, "pacer": pacer.url, "sglang-router": router.url}, procs
        for p in procs.values():
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} died during the benchmark:\n{p.log_tail()}")


def cpu_plan(pin: bool) -> dict[str, frozenset[int]]:
    """Which CPUs each role may use: with ``pin`` and at least two CPUs, the proxy (or the router; only
    one of them carries traffic at a time) gets the last CPU to itself among the benchmark's processes,
    and the worker and the client share the others. Empty without pinning (the OS places everything)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return {}
    rest = frozenset(cpus[:-1])
    return {"middle": frozenset(cpus[-1:]), "worker": rest, "client": rest}


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


def _loop_run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Both phases, each with its own worker, proxy and router (all stopped after); returns the report."""
    started: list[dict[str, Any]] = []
    pins = cpu_plan(args.pin)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_client_pinned(pins.get("client")))
        logs = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        with _arms(logs, args.time_scale, args, "latency", started) as (urls, procs):
            model = _model(urls["direct"])
            say(
                f"latency phase: worker x{args.time_scale:g} {urls['direct']}, pacer {urls['pacer']}, "
                f"sglang-router {urls['sglang-router']}; load average {os.getloadavg()[0]:.2f}"
            )
            body = completion_body(model, PROMPT, args.output_len)

            async def latency_rounds() -> list[dict[str, dict[str, Any]]]:
                return [await _latency_round(urls, procs, body, r, args, say) for r in range(args.rounds)]

            latency = _loop_run(latency_rounds())
        with _arms(logs, args.stream_time_scale, args, "stream", started) as (urls, procs):
            say(
                f"streaming phase: worker x{args.stream_time_scale:g}, {args.stream_concurrency} streams of "
                f"{args.stream_output_len} tokens; load average {os.getloadavg()[0]:.2f}"
            )
            body = completion_body(model, PROMPT, args.stream_output_len)

            async def stream_rounds() -> list[dict[str, dict[str, Any]]]:
                return [await _stream_round(urls, procs, body, r, args, say) for r in range(args.rounds)]

            stream = _loop_run(stream_rounds())
    report = aggregate(latency, stream)
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("report", "log_dir")}
    report["cpu_count"] = os.cpu_count()
    report["cpu_affinity"] = (
        {
            "pacer": sorted(pins["middle"]),
            "sglang-router": sorted(pins["middle"]),
            "worker": sorted(pins["worker"]),
            "client": sorted(pins["client"]),
        }
        if pins
        else None
    )
    report["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    report["processes"] = started  # all stopped by now
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests overhead", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--report", type=Path, default=None, help="write the figures as JSON here")
    a("--rate", type=float, default=500.0, help="requests per second in the latency phase")
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
    print(
        f"\npacer: added TTFT p50 {report['pacer_added_ttft_p50_ms']} ms, p99 {report['pacer_added_ttft_p99_ms']} ms, "
        f"throughput x{report['pacer_throughput_ratio']}, {report['pacer_chunks_per_cpu_s']} chunks per CPU-second; "
        f"sglang-router: +{report['router_added_ttft_p50_ms']} / +{report['router_added_ttft_p99_ms']} ms, "
        f"x{report['router_throughput_ratio']}, {report['router_chunks_per_cpu_s']} chunks per CPU-second"
    )
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
