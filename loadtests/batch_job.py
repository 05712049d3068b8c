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
4. **interactive**: ``--rounds`` rounds, each an interactive phase with nothing else running and one
   while a batch (``--load-lines``) runs, the order alternating; a phase is ``--interactive-requests``
   streamed requests through the proxy, a Poisson stream at ``--interactive-rate`` (a p99 of 1,000
   samples, not of 80 where it is the worst one). Target: the median over rounds of the per-round
   p99 TTFT ratio (with the batch / without) within 1.5x. Each phase also records how late the
   client's own loop sent (send lag) and the fraction of the phase the proxy, the worker and the
   client were runnable but waiting for a CPU (``/proc/<pid>/task/*/schedstat``): stalls of the
   machine, told apart from the design's.

The proxy's policy: ``[pacing]`` as ``policies/default.toml`` ships it, unchanged (the interactive
protection has no key: its numbers come from the worker's server info and scrapes), ``[control]``
off (the request path alone), ``batch.concurrency`` ``--batch-concurrency``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import tomli_w

from loadtests.loadgen import completion_body, open_loop, summarize
from loadtests.procs import Proc, runqueue_wait_seconds, start_pacer, start_sim

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served name
SHIPPED_POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.toml"  # what `make run` serves


def request_body(i: int, prompt_tokens: int, output_len: int, tag: str = "") -> dict[str, Any]:
    """One line's request: a distinct prompt of about ``prompt_tokens`` tokens, exactly ``output_len`` out
    (``tag`` sets one job's prompts apart from another's, so that none finds the other's in the prefix cache)."""
    return {
        "model": MODEL,
        "prompt": f"{tag}request {i}: " + "lorem ipsum " * max(1, prompt_tokens // 2),
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def jsonl(lines: int, prompt_tokens: int, output_len: int, tag: str = "") -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": request_body(i, prompt_tokens, output_len, tag),
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


async def running_limits(proxy_url: str) -> list[int | None]:
    """Each worker's running-request limit as the proxy read it (``/admin/workers``): what its
    interactive protection is derived from."""
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/admin/workers") as r:
        doc = await r.json()
    return [w.get("running_limit") for w in doc["workers"]]


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


def shipped_pacing() -> dict[str, Any]:
    """The ``[pacing]`` table of :data:`SHIPPED_POLICY`, as it is."""
    pacing: dict[str, Any] = tomllib.loads(SHIPPED_POLICY.read_text())["pacing"]
    return pacing


def proxy_policy(engine: dict[str, Any], batch_dir: Path, batch_concurrency: int) -> str:
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0.0},
        "queue": {"capacity": 200000, "timeout_s": 3600.0},
        "engine": engine,
        "pacing": shipped_pacing(),
        "control": {"mode": "off"},
        "batch": {"dir": str(batch_dir), "concurrency": batch_concurrency},
    })  # fmt: skip


DESIGNS = ("shipped", "priority")


@contextlib.contextmanager
def _proxy(log_dir: Path, args: argparse.Namespace, design: str, name: str) -> Iterator[tuple[Proc, list[int]]]:
    """The proxy in front of one fresh simulated worker, as ``design`` deploys it, with the shipped
    ``[pacing]`` either way.

    ``shipped``: an external worker with SGLang's defaults (FCFS queue) and ``--max-running``; the proxy
    reads its running-request limit from its server info. ``priority``: a worker the proxy starts itself
    with ``enable_priority_scheduling`` (what an operator's policy says); the proxy then marks each
    request with its class's priority. Yields the proxy and the process ids of the workers it did not
    start itself.
    """
    policy_dir, conc = log_dir / name, args.batch_concurrency
    if design == "shipped":
        with _sim(log_dir, args, f"{name}-sim") as sim:
            engine: dict[str, Any] = {"kind": "external", "urls": [sim.url]}
            with start_pacer(log_dir, [], name=name, policy_text=proxy_policy(engine, policy_dir, conc)) as p:
                yield p, [sim.pid]
        return
    engine = {
        "kind": "sim",
        "workers": 1,
        "args": {"max_running_requests": args.max_running, "enable_priority_scheduling": True,
                 "sim_time_scale": args.time_scale, "sim_startup_seconds": 0.2, "log_level": "warning"},
        "log_dir": str(log_dir / f"{name}-workers"),
    }  # fmt: skip
    with start_pacer(log_dir, [], name=name, policy_text=proxy_policy(engine, policy_dir, conc)) as p:
        yield p, []


def _descendants(pid: int) -> list[int]:
    """The process ids under ``pid`` (its children, theirs, ...), from ``/proc``; gone ones skipped."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


def _cpu_wait(pids: Sequence[int]) -> float:
    """Seconds the processes ``pids`` were runnable but waiting for a CPU; gone ones count 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += runqueue_wait_seconds(pid)
    return total


async def _phase(
    proxy: Proc, worker_pids: Sequence[int], args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    """One phase of ``--interactive-requests`` streamed requests, a Poisson stream at ``--interactive-rate``,
    with how much the machine held back the client (its send lag), the proxy and the worker (their CPU wait)."""
    body = completion_body(MODEL, "an interactive question", args.interactive_len)
    groups = {"pacer": [proxy.pid], "worker": list(worker_pids), "client": [os.getpid()]}
    wait0 = {name: _cpu_wait(pids) for name, pids in groups.items()}
    res = await open_loop(
        proxy.url + "/v1/completions", body, rate=args.interactive_rate,
        duration_s=args.interactive_requests / args.interactive_rate, poisson=rng,
    )  # fmt: skip
    out = summarize(res)
    for name, pids in groups.items():
        out[f"{name}_cpu_wait_fraction"] = round((_cpu_wait(pids) - wait0[name]) / max(res.wall_s, 1e-9), 3)
    return out


async def _rounds(proxy: Proc, worker_pids: Sequence[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--rounds`` rounds of an interactive phase with no batch and one beside a batch, the order
    alternating from round to round (drift of the machine falls on both arms). The batch of a
    ``with_batch`` phase (``--load-lines``, prompts of its own round) is started and given
    ``--interactive-delay`` to fill the worker, then cancelled when the phase ends and drained before
    the next phase."""
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="bench", max_retries=0, timeout=600)
    rounds: list[dict[str, Any]] = []
    async with client:
        for r in range(args.rounds):
            load = jsonl(args.load_lines or args.lines, args.prompt_tokens, args.output_len, tag=f"round {r} ")
            file = await client.files.create(file=("load.jsonl", load), purpose="batch")
            rnd: dict[str, Any] = {"order": ["alone", "with_batch"] if r % 2 == 0 else ["with_batch", "alone"]}
            for arm in rnd["order"]:
                if arm == "alone":
                    rnd[arm] = await _phase(proxy, worker_pids, args, rng)
                    continue
                batch = await client.batches.create(
                    input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
                )
                while batch.status == "validating":
                    await asyncio.sleep(args.poll_s)
                    batch = await client.batches.retrieve(batch.id)
                await asyncio.sleep(args.interactive_delay)  # the batch fills the worker first
                rnd[arm] = await _phase(proxy, worker_pids, args, rng)
                batch = await client.batches.retrieve(batch.id)
                rnd[arm]["batch_ran_throughout"] = batch.status == "in_progress"
                with contextlib.suppress(openai.ConflictError):  # it may have finished meanwhile
                    await client.batches.cancel(batch.id)
                while batch.status not in ("completed", "failed", "expired", "cancelled"):
                    await asyncio.sleep(args.poll_s)
                    batch = await client.batches.retrieve(batch.id)
            a, w = rnd["alone"]["ttft_p99_ms"], rnd["with_batch"]["ttft_p99_ms"]
            rnd["p99_ratio"] = round(w / a, 3) if a and w else None
            rounds.append(rnd)
    return rounds


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def summarize_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: each arm's TTFT p50/p99 and machine-stall signs, and the per-round p99 ratio."""
    out: dict[str, Any] = {"rounds": len(rounds), "p99_ratio_median": _median([r["p99_ratio"] for r in rounds]),
                           "p99_ratios": [r["p99_ratio"] for r in rounds]}  # fmt: skip
    for arm in ("alone", "with_batch"):
        out[arm] = {
            key: _median([r[arm][key] for r in rounds])
            for key in ("ttft_p50_ms", "ttft_p99_ms", "client_send_lag_p99_ms", "client_send_lag_max_ms",
                        "pacer_cpu_wait_fraction", "worker_cpu_wait_fraction", "client_cpu_wait_fraction")
        }  # fmt: skip
        out[arm]["requests"] = sum(r[arm]["requests"] for r in rounds)
        out[arm]["errors"] = sum(r[arm]["errors"] for r in rounds)
    out["with_batch"]["batch_ran_throughout"] = all(r["with_batch"]["batch_ran_throughout"] for r in rounds)
    return out


def _design(
    args: argparse.Namespace, log_dir: Path, design: str, data: bytes, direct_s: float, say: Any
) -> dict[str, Any]:
    """Phases 3 and 4 for one design: the job through the proxy, then the interactive rounds."""
    out: dict[str, Any] = {}
    with _proxy(log_dir, args, design, f"{design}-batch-pacer") as (proxy, _):
        out["batch"] = asyncio.run(run_batch(proxy.url, data, args.poll_s))
        out["running_limits"] = asyncio.run(running_limits(proxy.url))
    say(f"{design}: batch through the proxy: {out['batch']['seconds']} s ({out['batch']['status']})")
    with _proxy(log_dir, args, design, f"{design}-interactive-pacer") as (proxy, sims):
        workers = [*sims, *_descendants(proxy.pid)]
        out["interactive_rounds"] = asyncio.run(_rounds(proxy, workers, args))
    out["interactive"] = summary = summarize_rounds(out["interactive_rounds"])
    out["batch_vs_direct_throughput"] = round(direct_s / out["batch"]["seconds"], 4)
    out["interactive_p99_ttft_ratio"] = ratio = summary["p99_ratio_median"]
    out["targets"] = {
        "batch_vs_direct_throughput >= 0.97": out["batch_vs_direct_throughput"] >= 0.97,
        "interactive_p99_ttft_ratio <= 1.5": ratio is not None and ratio <= 1.5,
    }
    a, w = summary["alone"], summary["with_batch"]
    say(
        f"{design}: throughput {out['batch_vs_direct_throughput']} of direct; interactive TTFT p50/p99 (median of "
        f"{summary['rounds']} rounds) {a['ttft_p50_ms']}/{a['ttft_p99_ms']} ms alone, {w['ttft_p50_ms']}/"
        f"{w['ttft_p99_ms']} ms with the batch; p99 ratios {summary['p99_ratios']} (median {ratio}x); "
        f"send lag p99 {a['client_send_lag_p99_ms']}/{w['client_send_lag_p99_ms']} ms, pacer CPU wait "
        f"{a['pacer_cpu_wait_fraction']}/{w['pacer_cpu_wait_fraction']}"
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
        "pacing": shipped_pacing(),  # every design's, as policies/default.toml ships it
        "pacing_is_shipped": True,
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
    for name in ("batch", "interactive", "batch_vs_direct_throughput", "interactive_p99_ttft_ratio", "targets"):
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
    p.add_argument(
        "--time-scale", type=float, default=1.0,
        help="the simulator's --sim-time-scale (at 1 its steps take their modelled time: faster scales measure "
        "the machine more than the design)",
    )  # fmt: skip
    p.add_argument("--batch-concurrency", type=int, default=1024)
    p.add_argument(
        "--designs",
        nargs="+",
        choices=DESIGNS,
        default=["shipped"],
        help="shipped: an FCFS worker behind the shipped [pacing]; priority: the same, the worker ordering its "
        "queue by class (priority scheduling)",
    )
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument(
        "--interactive-rate", type=float, default=50.0,
        help="mean requests/s of the interactive Poisson stream (wall time: at --time-scale 10, 5/s of engine time)",
    )  # fmt: skip
    p.add_argument("--interactive-requests", type=int, default=1000, help="interactive requests per phase")
    p.add_argument("--interactive-len", type=int, default=32)
    p.add_argument("--interactive-delay", type=float, default=2.0, help="seconds the batch runs before a phase")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (no batch, with batch), order alternating")
    p.add_argument(
        "--load-lines", type=int, default=0,
        help="lines of the batch beside the interactive phases (cancelled when a phase ends; default --lines)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=14, help="seed of the interactive arrival times")
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
