"""A Batch API job through the proxy vs a client straight to the worker:
``python -m loadtests batch [--report FILE.json]``.

Every phase runs on a fresh ``pacer sim`` worker (same flags, ``--sim-time-scale`` bounds the time):

1. **sweep**: a client sends ``--sweep-requests`` non-streamed completions straight to the worker at
   each constant concurrency of ``--concurrency`` and the best throughput wins.
2. **direct**: the whole job (``--lines`` requests) straight to the worker at that best concurrency:
   its completion time is the bar.
3. **batch**: the same requests as one JSONL file through the proxy's Batch API (``files.create``,
   ``batches.create``, poll until ``completed``, with the ``openai`` client); completion time from
   ``batches.create`` to ``completed``, every line checked in the output file. Target: the direct
   completion time / this one >= 0.97.
4. **interactive**: streamed interactive requests at ``--interactive-rate`` through the proxy, for
   ``--interactive-duration`` seconds with nothing else running, then again while a second batch of
   the same job runs; their p99 TTFTs. Target: with the batch within 1.5x of without.

The proxy's policy: the worker's queue band ``--band`` (the pacing gate keeps that many requests
waiting in the worker beyond those running), ``batch.concurrency`` ``--batch-concurrency``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import tomli_w

from loadtests.loadgen import completion_body, open_loop, summarize
from loadtests.procs import Proc, start_pacer, start_sim

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name


def request_body(i: int, prompt_tokens: int, output_len: int) -> dict[str, Any]:
    """One line's request: a distinct prompt of about ``prompt_tokens`` tokens, exactly ``output_len`` out."""
    return {
        "model": MODEL,
        "prompt": f"request {i}: " + "lorem ipsum " * max(1, prompt_tokens // 2),
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def jsonl(lines: int, prompt_tokens: int, output_len: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": request_body(i, prompt_tokens, output_len),
            }
        )
        + b"\n"
        for i in range(lines)
    )


async def direct(url: str, bodies: Sequence[bytes], concurrency: int) -> dict[str, Any]:
    """All ``bodies`` straight to the worker from ``concurrency`` clients; seconds and errors."""
    queue = iter(bodies)
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def client() -> None:
            nonlocal errors
            for body in queue:
                async with s.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    errors += r.status != 200

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"requests": len(bodies), "concurrency": concurrency, "seconds": round(elapsed, 3),
            "requests_per_s": round(len(bodies) / elapsed, 2), "errors": errors}  # fmt: skip


async def run_batch(proxy_url: str, data: bytes, poll_s: float) -> dict[str, Any]:
    """One batch through the proxy's Batch API with the openai client; completion time and counts."""
    client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="bench", max_retries=0, timeout=600)
    async with client:
        file = await client.files.create(file=("job.jsonl", data), purpose="batch")
        t0 = time.perf_counter()
        batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(poll_s)
            batch = await client.batches.retrieve(batch.id)
        elapsed = time.perf_counter() - t0
        ok = errors = 0
        seen: set[str] = set()
        if batch.output_file_id:
            for line in (await client.files.content(batch.output_file_id)).content.splitlines():
                doc = orjson.loads(line)
                seen.add(doc["custom_id"])
                ok += doc["response"]["status_code"] == 200
        if batch.error_file_id:
            errors = len((await client.files.content(batch.error_file_id)).content.splitlines())
    counts = batch.request_counts
    return {"status": batch.status, "seconds": round(elapsed, 3), "ok": ok, "error_lines": errors,
            "distinct_ids": len(seen), "completed": counts.completed if counts else None,
            "failed": counts.failed if counts else None}  # fmt: skip


async def interactive(proxy_url: str, rate: float, duration_s: float, output_len: int) -> dict[str, Any]:
    body = completion_body(MODEL, "an interactive question", output_len)
    return summarize(await open_loop(proxy_url + "/v1/completions", body, rate=rate, duration_s=duration_s))


def proxy_policy(
    engine: dict[str, Any], batch_dir: Path, band: tuple[int, int], batch_concurrency: int, batch_queue: int = 0
) -> str:
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0.0},
        "queue": {"capacity": 200000, "timeout_s": 3600.0},
        "engine": engine,
        "pacing": {"queue_band": list(band), "headroom": 0, "scrape_interval_s": 0.1, "stale_after_s": 5.0,
                   "batch_queue_beside_interactive": batch_queue},
        "control": {"mode": "off"},
        "batch": {"dir": str(batch_dir), "concurrency": batch_concurrency},
    })  # fmt: skip


DESIGNS = ("band", "priority", "cap", "priority-cap")


@contextlib.contextmanager
def _proxy(log_dir: Path, args: argparse.Namespace, design: str, name: str) -> Iterator[Proc]:
    """The proxy in front of one fresh simulated worker, as ``design`` deploys it.

    ``band``: an external worker with SGLang's defaults (FCFS queue); the proxy knows nothing of its
    arguments. ``priority``: a worker the proxy starts itself with ``enable_priority_scheduling``
    (what an operator's policy says); the proxy then marks each request with its class's priority.
    ``cap``: as ``band`` plus ``pacing.batch_queue_beside_interactive = --batch-queue``; ``priority-cap``:
    both.
    """
    band, conc = tuple(args.band), args.batch_concurrency
    cap = args.batch_queue if design.endswith("cap") else 0
    if design in ("band", "cap"):
        with _sim(log_dir, args, f"{name}-sim") as sim:
            engine = {"kind": "external", "urls": [sim.url]}
            policy = proxy_policy(engine, log_dir / name, band, conc, cap)
            with start_pacer(log_dir, [], name=name, policy_text=policy) as p:
                yield p
        return
    engine = {
        "kind": "sim",
        "workers": 1,
        "args": {"max_running_requests": args.max_running, "enable_priority_scheduling": True,
                 "sim_time_scale": args.time_scale, "sim_startup_seconds": 0.2, "log_level": "warning"},
        "log_dir": str(log_dir / f"{name}-workers"),
    }  # fmt: skip
    with start_pacer(log_dir, [], name=name, policy_text=proxy_policy(engine, log_dir / name, band, conc, cap)) as p:
        yield p


def _design(
    args: argparse.Namespace, log_dir: Path, design: str, data: bytes, direct_s: float, say: Any
) -> dict[str, Any]:
    """Phases 3 and 4 for one design: the job through the proxy, then interactive alone and beside it."""
    out: dict[str, Any] = {}
    with _proxy(log_dir, args, design, f"{design}-batch-pacer") as proxy:
        out["batch"] = asyncio.run(run_batch(proxy.url, data, args.poll_s))
    say(f"{design}: batch through the proxy: {out['batch']['seconds']} s ({out['batch']['status']})")
    with _proxy(log_dir, args, design, f"{design}-interactive-pacer") as proxy:
        alone = asyncio.run(
            interactive(proxy.url, args.interactive_rate, args.interactive_duration, args.interactive_len)
        )

        async def during() -> tuple[dict[str, Any], dict[str, Any]]:
            job = asyncio.ensure_future(run_batch(proxy.url, data, args.poll_s))
            await asyncio.sleep(args.interactive_delay)  # the batch fills the worker first
            inter = await interactive(proxy.url, args.interactive_rate, args.interactive_duration, args.interactive_len)
            return inter, await job

        with_batch, second = asyncio.run(during())
    out["interactive_alone"] = alone
    out["interactive_with_batch"] = with_batch
    out["batch_during_interactive"] = second
    out["batch_vs_direct_throughput"] = round(direct_s / out["batch"]["seconds"], 4)
    a, w = alone.get("ttft_p99_ms"), with_batch.get("ttft_p99_ms")
    out["interactive_p99_ttft_ratio"] = round(w / a, 3) if a and w else None
    out["targets"] = {
        "batch_vs_direct_throughput >= 0.97": out["batch_vs_direct_throughput"] >= 0.97,
        "interactive_p99_ttft_ratio <= 1.5": out["interactive_p99_ttft_ratio"] is not None
        and out["interactive_p99_ttft_ratio"] <= 1.5,
    }
    say(
        f"{design}: throughput {out['batch_vs_direct_throughput']} of direct, interactive p99 TTFT "
        f"{a} ms alone, {w} ms with the batch ({out['interactive_p99_ttft_ratio']}x)"
    )
    return out


@contextlib.contextmanager
def _sim(log_dir: Path, args: argparse.Namespace, name: str) -> Iterator[Proc]:
    extra = ["--max-running-requests", str(args.max_running)]
    with start_sim(log_dir, time_scale=args.time_scale, extra=extra, name=name) as sim:
        yield sim


def run(args: argparse.Namespace, log_dir: Path, say: Any = print) -> dict[str, Any]:
    bodies = [orjson.dumps(request_body(i, args.prompt_tokens, args.output_len)) for i in range(args.lines)]
    data = jsonl(args.lines, args.prompt_tokens, args.output_len)
    report: dict[str, Any] = {
        "command": "python -m loadtests batch " + " ".join(sys.argv[2:]),
        "settings": vars(args).copy(),
    }
    sweep: list[dict[str, Any]] = []
    with _sim(log_dir, args, "sweep-sim") as sim:
        for c in args.concurrency:
            point = asyncio.run(direct(sim.url, bodies[: args.sweep_requests], c))
            say(f"sweep: concurrency {c}: {point['requests_per_s']} req/s")
            sweep.append(point)
    best = max(sweep, key=lambda p: p["requests_per_s"])["concurrency"]
    report["sweep"] = sweep
    with _sim(log_dir, args, "direct-sim") as sim:
        report["direct"] = asyncio.run(direct(sim.url, bodies, best))
    say(f"direct at concurrency {best}: {report['direct']['seconds']} s")
    for design in args.designs:
        report[design] = _design(args, log_dir, design, data, report["direct"]["seconds"], say)
    first = report[args.designs[0]]  # the headline keys of earlier reports: the first design's
    for name in ("batch", "interactive_alone", "interactive_with_batch", "batch_during_interactive",
                 "batch_vs_direct_throughput", "interactive_p99_ttft_ratio", "targets"):  # fmt: skip
        report[name] = first[name]
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests batch", description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, help="write the figures here as JSON")
    p.add_argument("--log-dir", type=Path, help="process logs and batch files (default: a temporary folder)")
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--sweep-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-running", type=int, default=256, help="the worker's --max-running-requests")
    p.add_argument("--time-scale", type=float, default=10.0, help="the simulator's --sim-time-scale")
    p.add_argument("--band", type=int, nargs=2, default=[32, 256], help="the proxy's pacing.queue_band")
    p.add_argument("--batch-concurrency", type=int, default=1024)
    p.add_argument(
        "--batch-queue", type=int, default=4, help="pacing.batch_queue_beside_interactive of the *cap designs"
    )
    p.add_argument(
        "--designs",
        nargs="+",
        choices=DESIGNS,
        default=list(DESIGNS),
        help="band: an FCFS worker behind the band; priority: the worker orders its queue by class; "
        "cap: the band, and a short batch queue while interactive requests arrive; priority-cap: both",
    )
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--interactive-rate", type=float, default=4.0)
    p.add_argument("--interactive-duration", type=float, default=10.0)
    p.add_argument("--interactive-len", type=int, default=32)
    p.add_argument("--interactive-delay", type=float, default=2.0)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pacer-batch-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        report = run(args, log_dir)
    for k in ("report",):
        report["settings"][k] = str(report["settings"][k]) if report["settings"][k] else None
    report["settings"]["log_dir"] = str(args.log_dir) if args.log_dir else None
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    return 0
