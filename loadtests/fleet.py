"""Two pools behind one proxy vs the same pools behind separate proxies: per-pool throughput.

    python -m loadtests fleet [--workers-a 2 --workers-b 2 --concurrency 48 --duration 20 --rounds 2]

The same simulated workers serve both arms (pool "a" serves model ``fleet-a``, pool "b"
``fleet-b``, each worker started with that served name). Arm ``one``: one ``pacer serve`` with two
``[[pool]]`` tables (external kind, so both arms front the very same servers). Arm ``separate``:
one ``pacer serve`` per pool. Each arm runs a closed loop per pool at the same concurrency, both
pools at once, and the report gives each pool's output tokens per second in each arm and the
ratio one / separate (target >= 0.98: one queue per node should not cost throughput). Arms
alternate over rounds; the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import tomli_w

from loadtests.loadgen import Counter, closed_loop, completion_body, summarize
from loadtests.procs import start_pacer, start_sim

POOLS = ("a", "b")
PACING = {"queue_band": [4, 64], "headroom": 8, "scrape_interval_s": 0.2, "stale_after_s": 5.0}


def model_of(pool: str) -> str:
    return f"fleet-{pool}"


def one_proxy_policy(urls: dict[str, list[str]]) -> str:
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0},
        "queue": {"capacity": 100000, "timeout_s": 120.0},
        "pool": [{"name": p, "model": model_of(p), "kind": "external", "urls": urls[p]} for p in POOLS],
        "pacing": PACING,
        "control": {"mode": "off"},
    })  # fmt: skip


def one_pool_policy(urls: list[str]) -> str:
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0},
        "queue": {"capacity": 100000, "timeout_s": 120.0},
        "engine": {"kind": "external", "urls": urls},
        "pacing": PACING,
        "control": {"mode": "off"},
    })  # fmt: skip


async def _load(targets: dict[str, str], concurrency: int, duration_s: float, max_tokens: int) -> dict[str, Any]:
    """Both pools at once, each its closed loop against its URL; per-pool summaries."""
    stop = asyncio.Event()
    runs = {
        p: asyncio.create_task(
            closed_loop(
                targets[p] + "/v1/completions",
                completion_body(model_of(p), f"pool {p} says hello", max_tokens),
                concurrency=concurrency,
                stop=stop,
                counter=Counter(),
            )
        )
        for p in POOLS
    }
    await asyncio.sleep(duration_s)
    stop.set()
    return {p: summarize(await task) for p, task in runs.items()}


def run(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    rounds: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        urls: dict[str, list[str]] = {p: [] for p in POOLS}
        for p, n in (("a", args.workers_a), ("b", args.workers_b)):
            for i in range(n):
                sim = stack.enter_context(
                    start_sim(
                        out_dir,
                        time_scale=args.time_scale,
                        name=f"sim-{p}{i}",
                        extra=["--served-model-name", model_of(p), "--max-running-requests", str(args.max_running)],
                    )
                )
                urls[p].append(sim.url)
        for r in range(args.rounds):
            arms = ("one", "separate") if r % 2 == 0 else ("separate", "one")
            result: dict[str, Any] = {}
            for arm in arms:
                with contextlib.ExitStack() as proxies:
                    if arm == "one":
                        proxy = proxies.enter_context(
                            start_pacer(out_dir, [], name="pacer-one", policy_text=one_proxy_policy(urls))
                        )
                        targets = {p: proxy.url for p in POOLS}
                    else:
                        targets = {
                            p: proxies.enter_context(
                                start_pacer(out_dir, [], name=f"pacer-{p}", policy_text=one_pool_policy(urls[p]))
                            ).url
                            for p in POOLS
                        }
                    result[arm] = asyncio.run(_load(targets, args.concurrency, args.duration, args.max_tokens))
                say(
                    f"round {r + 1} {arm}: "
                    + ", ".join(f"{p} {result[arm][p]['output_tok_per_s']} tok/s" for p in POOLS)
                )
            rounds.append(result)
    report: dict[str, Any] = {"rounds": rounds, "pools": {}}
    for p in POOLS:
        one = statistics.median(r["one"][p]["output_tok_per_s"] for r in rounds)
        sep = statistics.median(r["separate"][p]["output_tok_per_s"] for r in rounds)
        errors = sum(r[arm][p]["errors"] for r in rounds for arm in ("one", "separate"))
        report["pools"][p] = {
            "one_proxy_tok_per_s": one,
            "separate_proxies_tok_per_s": sep,
            "ratio": round(one / sep, 4) if sep else None,
            "errors": errors,
        }
    report["min_ratio"] = min((v["ratio"] or 0.0) for v in report["pools"].values())
    report["target"] = 0.98
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtests fleet", description=__doc__)
    ap.add_argument("--workers-a", type=int, default=2)
    ap.add_argument("--workers-b", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=48, help="clients per pool")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-running", type=int, default=32, help="each worker's --max-running-requests")
    ap.add_argument("--time-scale", type=float, default=10.0, help="the simulator's --sim-time-scale")
    ap.add_argument("--out-dir", default=".pacer/loadtests/fleet")
    ap.add_argument("--json", help="write the report here")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    for p, v in report["pools"].items():
        print(
            f"pool {p}: one proxy {v['one_proxy_tok_per_s']} tok/s, separate {v['separate_proxies_tok_per_s']} tok/s,"
            f" ratio {v['ratio']} (errors {v['errors']})"
        )
    print(f"min ratio {report['min_ratio']} (target >= {report['target']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
