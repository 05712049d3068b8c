"""Per-key limits across replicas, in memory vs shared over PostgreSQL:
``python -m loadtests limits [--replicas N] [--seconds S] [--rate R] [--report FILE.json]``.

Three replica processes (``--replicas``) each run a key limiter and send one key's requests at it,
open loop (``--rate`` a second each, in ticks of 5 ms); a request holds its lease ``--hold-ms``, as a
request on a worker would. No proxy and no engine: what a request waits for here is what the limiter
adds to its time to first token. Two measures, each for both limiters:

- **Cost**, under the limit (the fleet at ~60 % of requests a minute, tokens a minute and concurrency):
  the time ``admit`` takes, p50 and p99 over every admitted request; the shared limiter's excess over
  the in-memory one is its added TTFT. Also the store's own calls (p50/p99, one transaction each) and
  the share of requests that waited for one: a store call a request is what a per-request counter
  (in PostgreSQL or Redis) would cost.
- **Hold**, far over a requests-a-minute limit (``--over``: 6 x what it allows in the run, a full
  bucket and its refill): admitted over what the limit allows the fleet from its first admitted
  request to its last. In memory each replica has the whole limit (N x); shared, the fleet has it once.

PostgreSQL as Debian ships it, started for the run in a temporary directory on this host
(``tests.harness.postgres``), over TCP on 127.0.0.1; the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from proxy.request.limits import KeyLimiter, KeyLimits, RateLimited
from proxy.request.shared_limits import SharedKeyLimiter
from proxy.store import open_database
from proxy.store.budgets import BucketAsk, Budgets, SlotAsk

KEY = "bench"
TICK_S = 0.005
COST = 1000  # tokens a request


class _TimedBudgets(Budgets):
    """Budgets that time each store call taking from them, and count those a request waited for
    (those that ask for units a request needs, or for slots; not a top-up in the background)."""

    calls_ms: ClassVar[list[float]] = []
    waited: ClassVar[list[int]] = [0]

    def take(self, key: str, buckets: Sequence[BucketAsk], slots: SlotAsk | None, now: float) -> Any:
        start = time.perf_counter()
        try:
            return super().take(key, buckets, slots, now)
        finally:
            _TimedBudgets.calls_ms.append((time.perf_counter() - start) * 1000)
            _TimedBudgets.waited[0] += slots is not None or any(ask.need > 0 for ask in buckets)


def _limiter(spec: dict[str, Any]) -> KeyLimiter:
    limits = {KEY: KeyLimits(**spec["limits"])}
    if not spec["url"]:
        return KeyLimiter(limits)
    url, holder = spec["url"], f"replica-{spec['n']}"
    return SharedKeyLimiter(limits, lambda: _TimedBudgets(open_database(url, Path(), "unused"), holder))


async def _drive(spec: dict[str, Any]) -> dict[str, Any]:
    """One replica: open-loop requests at ``rate`` a second from ``start_at`` (wall clock) for ``seconds``."""
    _TimedBudgets.calls_ms, _TimedBudgets.waited = [], [0]
    limiter = _limiter(spec)
    await limiter.start()
    loop = asyncio.get_running_loop()
    admitted_us: list[float] = []
    admitted_at: list[float] = []
    refused = 0

    async def one() -> None:
        nonlocal refused
        start = time.perf_counter()
        try:
            lease = await limiter.admit(KEY, COST, time.monotonic())
        except RateLimited:
            refused += 1
            return
        admitted_us.append((time.perf_counter() - start) * 1e6)
        admitted_at.append(time.time())
        loop.call_later(spec["hold_s"], lease.release)

    await asyncio.sleep(max(0.0, spec["start_at"] - time.time()))
    tasks: set[asyncio.Task[None]] = set()
    sent, began = 0, time.monotonic()
    while (elapsed := time.monotonic() - began) < spec["seconds"]:
        while sent < spec["rate"] * elapsed:  # on the clock, whatever the ticks' drift
            sent += 1
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(TICK_S)
    await asyncio.gather(*tasks)
    await asyncio.sleep(spec["hold_s"])
    await limiter.close()
    return {
        "admitted_us": admitted_us,
        "admitted_at": admitted_at,
        "refused": refused,
        "store_ms": _TimedBudgets.calls_ms,
        "waited": _TimedBudgets.waited[0],
    }


def _replica(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_drive(spec))


def _fleet(pool: Any, url: str, limits: dict[str, int], args: argparse.Namespace) -> list[dict[str, Any]]:
    start_at = time.time() + 0.3  # every replica sends from the same instant
    specs = [
        {"n": n, "url": url, "limits": limits, "rate": args.rate, "seconds": args.seconds}
        | {"hold_s": args.hold_ms / 1000, "start_at": start_at}
        for n in range(args.replicas)
    ]
    return list(pool.map(_replica, specs, chunksize=1))


def _warm(_n: int) -> None:
    """A pool's process has imported this module (the proxy's modules with it)."""


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cost(runs: list[dict[str, Any]]) -> dict[str, Any]:
    us = [x for r in runs for x in r["admitted_us"]]
    store = [x for r in runs for x in r["store_ms"]]
    return {
        "admitted": len(us),
        "refused": sum(r["refused"] for r in runs),
        "admit_p50_us": _pct(us, 0.5),
        "admit_p99_us": _pct(us, 0.99),
        "store_calls": len(store),
        "waited_for_store": sum(r["waited"] for r in runs),
        "store_call_p50_ms": _pct(store, 0.5),
        "store_call_p99_ms": _pct(store, 0.99),
    }


def _hold(runs: list[dict[str, Any]], per_minute: int) -> dict[str, Any]:
    times = [t for r in runs for t in r["admitted_at"]]
    span = max(times) - min(times) if times else 0.0
    allowed = per_minute + per_minute * span / 60
    return {"admitted": len(times), "span_s": span, "allowed": allowed, "ratio": len(times) / allowed}


def run(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    from tests.harness.postgres import local_postgres

    fleet_rate = args.rate * args.replicas
    cost_limits = {
        "requests_per_minute": round(fleet_rate * 60 / 0.6),
        "tokens_per_minute": round(fleet_rate * 60 * COST / 0.6),
        "max_concurrent": max(4, round(fleet_rate * args.hold_ms / 1000 / 0.6)),
    }
    offered = fleet_rate * args.seconds  # over what a limit allows in the run: a full bucket and its refill
    hold_limits = {"requests_per_minute": max(1, round(offered / (args.over * (1 + args.seconds / 60))))}
    load_before = os.getloadavg()
    report: dict[str, Any] = {"replicas": args.replicas, "seconds": args.seconds, "rate_per_replica": args.rate}
    report |= {"cost_limits": cost_limits, "hold_limits": hold_limits, "cost": {}, "hold": {}}
    with local_postgres(durable=True) as server, multiprocessing.get_context("spawn").Pool(args.replicas) as pool:
        pool.map(_warm, range(args.replicas), chunksize=1)
        for arm in ("memory", "shared"):
            url = server.create_database(f"cost_{arm}") if arm == "shared" else ""
            report["cost"][arm] = _cost(_fleet(pool, url, cost_limits, args))
            url = server.create_database(f"hold_{arm}") if arm == "shared" else ""
            report["hold"][arm] = _hold(_fleet(pool, url, hold_limits, args), hold_limits["requests_per_minute"])
    mem, shared = report["cost"]["memory"], report["cost"]["shared"]
    report["added_ttft_p50_ms"] = (shared["admit_p50_us"] - mem["admit_p50_us"]) / 1000
    report["added_ttft_p99_ms"] = (shared["admit_p99_us"] - mem["admit_p99_us"]) / 1000
    report["waited_for_store"] = shared["waited_for_store"] / max(1, shared["admitted"] + shared["refused"])
    report |= {"loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    _say(report, say)
    return report


def _say(report: dict[str, Any], say: Any) -> None:
    for arm, c in report["cost"].items():
        say(
            f"{arm:7s} admit p50 {c['admit_p50_us']:.0f} us, p99 {c['admit_p99_us']:.0f} us "
            f"({c['admitted']} admitted, {c['refused']} refused)"
        )
    s = report["cost"]["shared"]
    say(
        f"shared adds {report['added_ttft_p50_ms']:.3f} ms p50, {report['added_ttft_p99_ms']:.3f} ms p99; "
        f"store calls {s['store_calls']} ({report['waited_for_store']:.1%} of requests waited for one), "
        f"p50 {s['store_call_p50_ms']:.3f} ms, p99 {s['store_call_p99_ms']:.3f} ms each"
    )
    for arm, h in report["hold"].items():
        say(f"{arm:7s} over the limit: {h['admitted']} admitted of {h['allowed']:.0f} allowed ({h['ratio']:.3f})")
    b, a = report["loadavg_before"][0], report["loadavg_after"][0]
    say(f"load average {b:.1f} before, {a:.1f} after, {report['cpus']} CPUs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests limits", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="replica processes")
    p.add_argument("--seconds", type=float, default=20.0, help="each arm's sending time")
    p.add_argument("--rate", type=float, default=100.0, help="requests a second each replica sends")
    p.add_argument("--hold-ms", type=float, default=50.0, help="how long an admitted request holds its lease")
    p.add_argument(
        "--over", type=float, default=6.0, help="the hold measure's requests over what its limit allows in the run"
    )
    p.add_argument("--report", type=Path, help="write the figures here as JSON")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
