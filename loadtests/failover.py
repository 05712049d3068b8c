"""``python -m loadtests failover``: three ``pacer serve`` replicas on one PostgreSQL, the leader killed.

Two parts, each on its own simulated workers and a fresh PostgreSQL (Debian's ``postgresql``, as the
tests start it):

- **pacing**: bursty traffic (each replica's clients send bursts at once) through three replicas in
  front of the same workers, each worker's ``#queue-req`` read from the worker every 20 ms. Arm
  ``alone``: three proxies without a store, each pacing as if it were the only one. Arm ``share``:
  the same three on the store, each pacing its share (the room in the band divided by the live
  replicas). Reported: the queue's p50/p99/max and the share of samples above the band's top.
- **failover**: the replicas launch the workers (the leader does), traffic on all three, the leader
  SIGKILLed. Reported: seconds to a new leader and until it serves the workers it adopted, the
  workers' pids before and after, the requests failed on the dead replica and on the survivors, the
  survivors' latency p50/p99 before and after, and the queues as above. The lease and the polls are
  the ones every fleet runs (:mod:`proxy.workers.replicas`): the policy sets only the store's url.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from loadtests.procs import Proc, start_pacer, start_sim
from proxy.workers.lease import proc_start, read_lease


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The fleet and its traffic."""

    replicas: int = 3
    workers: int = 2
    running: int = 8  # each worker's --max-running-requests
    band: tuple[int, int] = (2, 8)
    headroom: int = 2
    time_scale: float = 10.0
    burst: int = 12  # requests a client sends at once
    clients: int = 2  # per replica
    gap_s: float = 0.3  # between a client's bursts
    max_tokens: int = 32


@dataclass(slots=True)
class Traffic:
    """Every request sent: (replica index, start, seconds, ok), and each worker's queue samples."""

    requests: list[tuple[int, float, float, bool]] = field(default_factory=list)
    queues: dict[str, list[int]] = field(default_factory=dict)


def policy(
    shape: Shape, folder: Path, *, store_url: str, workers: Sequence[str] = (), log_dir: Path | None = None
) -> str:
    """A replica's policy: in front of ``workers`` (external), or launching sim workers into ``log_dir``;
    its batches in ``folder``."""
    if workers:
        engine: dict[str, Any] = {"kind": "external", "urls": list(workers), "speaks": "sglang"}
    else:
        engine = {
            "kind": "sim",
            "workers": shape.workers,
            "log_dir": str(log_dir),
            "startup_timeout_s": 60.0,
            "stop_grace_s": 5.0,
            "args": {
                "sim_time_scale": shape.time_scale,
                "sim_startup_seconds": 0.3,
                "enable_metrics": True,
                "max_running_requests": shape.running,
            },
        }
    table: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0},
        "queue": {"capacity": 10000, "timeout_s": 120.0},
        "engine": engine,
        "pacing": {"queue_band": list(shape.band), "headroom": shape.headroom},
        "control": {"mode": "off"},
        "batch": {"dir": str(folder)},
    }
    if store_url:
        table["store"] = {"url": store_url}
    return tomli_w.dumps(table)


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def roles(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each answering replica's part (``/admin/workers``'s ``replica``) and workers, by its URL."""
    out: dict[str, dict[str, Any]] = {}
    for url in urls:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            body = await get_json(session, url + "/admin/workers")
            out[url] = {**body.get("replica", {}), "workers": {w["id"]: w for w in body["workers"]}}
    return out


async def queue_of(session: aiohttp.ClientSession, worker: str) -> int | None:
    try:
        async with session.get(worker + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    for line in text.splitlines():
        if line.startswith("sglang:num_queue_reqs"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


async def sample_queues(workers: Sequence[str], traffic: Traffic, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for worker in workers:
                q = await queue_of(session, worker)
                if q is not None:
                    traffic.queues.setdefault(worker, []).append(q)
            await asyncio.sleep(0.02)


_said_why: list[bytes] = []  # the first failure's answer, shown once


async def ask(session: aiohttp.ClientSession, url: str, shape: Shape) -> bool:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": shape.max_tokens,
        "sim_output_len": shape.max_tokens,
    }
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            text = await resp.read()
            if resp.status != 200 and not _said_why:
                _said_why.append(text)
                print(f"a request failed: HTTP {resp.status}: {text[:300]!r}", file=sys.stderr)
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def client(index: int, url: str, shape: Shape, traffic: Traffic, stop: asyncio.Event) -> None:
    """Bursts of ``shape.burst`` requests at once, ``gap_s`` apart, until ``stop``."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        while not stop.is_set():

            async def one() -> None:
                start = time.monotonic()
                ok = await ask(session, url, shape)
                traffic.requests.append((index, start, time.monotonic() - start, ok))

            await asyncio.gather(*(one() for _ in range(shape.burst)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), shape.gap_s)


@contextlib.asynccontextmanager
async def loaded(urls: Sequence[str], workers: Sequence[str], shape: Shape, traffic: Traffic) -> AsyncIterator[None]:
    """Traffic on every replica and the queues sampled while the block runs."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(sample_queues(workers, traffic, stop))]
    tasks += [
        asyncio.create_task(client(i, url, shape, traffic, stop))
        for i, url in enumerate(urls)
        for _ in range(shape.clients)
    ]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def queue_report(traffic: Traffic, band: tuple[int, int]) -> dict[str, Any]:
    every = [q for qs in traffic.queues.values() for q in qs]
    return {
        "samples": len(every),
        "p50": pct(every, 0.5),
        "p99": pct(every, 0.99),
        "max": max(every, default=0),
        "over_band": round(sum(q > band[1] for q in every) / max(1, len(every)), 4),
        "per_worker_max": {w: max(qs) for w, qs in traffic.queues.items()},
    }


@contextlib.contextmanager
def replicas(folder: Path, count: int, text: Callable[[Path], str]) -> Iterator[list[Proc]]:
    """``count`` ``pacer serve`` replicas, each with ``text(its batch folder)`` for its policy, started
    in turn (each ready before the next)."""
    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(count):
            policy_text = text(folder / f"batches-{i}")
            procs.append(stack.enter_context(start_pacer(folder, [], name=f"replica-{i}", policy_text=policy_text)))
        yield procs


def stop_leased_workers(log_dir: Path) -> None:
    """End every worker process a lease in ``log_dir`` names (whatever the replicas left behind)."""
    for lease in log_dir.glob("*.lease"):
        record = read_lease(lease) or {}
        pid = record.get("pid")
        if isinstance(pid, int) and proc_start(pid) == record.get("pid_start"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def pacing_arm(shape: Shape, folder: Path, store_url: str, seconds: float) -> dict[str, Any]:
    """Bursty traffic through the replicas in front of external sims; the queues' figures."""
    traffic = Traffic()
    with contextlib.ExitStack() as stack:
        sims = [
            stack.enter_context(
                start_sim(folder, time_scale=shape.time_scale, extra=["--max-running-requests", str(shape.running)],
                          name=f"sim-{i}")
            )
            for i in range(shape.workers)
        ]  # fmt: skip
        workers = [s.url for s in sims]
        text = functools.partial(policy, shape, store_url=store_url, workers=workers)
        with replicas(folder, shape.replicas, text) as procs:
            async with loaded([p.url for p in procs], workers, shape, traffic):
                await asyncio.sleep(seconds)
    done = [r for r in traffic.requests if r[3]]
    return {
        "queue": queue_report(traffic, shape.band),
        "answered": len(done),
        "failed": len(traffic.requests) - len(done),
        "throughput_rps": round(len(done) / seconds, 2),
    }


@dataclass(slots=True)
class Fleet:
    """The replicas of a failover run, as the run found them."""

    procs: list[Proc]
    urls: list[str]
    leader: int  # index of the replica that leads
    workers: dict[str, dict[str, Any]]  # as the leader shows them, by id


async def settled(session: aiohttp.ClientSession, procs: list[Proc], shape: Shape) -> Fleet:
    """Once every replica serves every worker READY and one of them leads them: the fleet."""
    from tests.harness.wait import wait_until

    urls = [p.url for p in procs]

    async def check() -> Fleet | None:
        seen = await roles(session, urls)
        if len(seen) != len(urls):
            return None
        ready = [
            len(r["workers"]) == shape.workers
            and all(w["state"] == "ready" and w["pid"] for w in r["workers"].values())
            for r in seen.values()
        ]
        leading = [i for i, url in enumerate(urls) if seen[url].get("serving") == "leader"]
        if not all(ready) or len(leading) != 1:
            return None
        return Fleet(procs, urls, leading[0], seen[urls[leading[0]]]["workers"])

    fleet = await wait_until(check, "every replica serving the workers, one leading them", timeout=90, every=0.1)
    assert fleet is not None  # a wait returns what held
    return fleet


async def kill_leader(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, Any]:
    """SIGKILL the leader; the seconds until a survivor leads and until it serves the workers it
    adopted, and that replica's index."""
    from tests.harness.wait import wait_until

    doomed = fleet.procs[fleet.leader]
    killed = time.monotonic()
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.popen.wait()
    survivors = [url for i, url in enumerate(fleet.urls) if i != fleet.leader]
    marks: dict[str, float] = {}

    async def led() -> str | None:
        for url, role in (await roles(session, survivors)).items():
            if role.get("leader"):
                marks.setdefault("leader", time.monotonic() - killed)
            if role.get("serving") == "leader":
                return url
        return None

    url = await wait_until(led, "a surviving replica leading the workers", timeout=60, every=0.05)
    assert url is not None  # a wait returns what held
    return {
        "killed_at": killed,
        "to_leader_s": round(marks.get("leader", time.monotonic() - killed), 3),
        "to_serving_s": round(time.monotonic() - killed, 3),
        "new_leader": fleet.urls.index(url),
    }


def latency_report(traffic: Traffic, killed_at: float, dead: int) -> dict[str, Any]:
    """The survivors' answers before and after the kill, and what failed where."""
    survivors = [r for r in traffic.requests if r[0] != dead]
    before = [r[2] for r in survivors if r[1] < killed_at and r[3]]
    after = [r[2] for r in survivors if r[1] >= killed_at and r[3]]
    on_dead = [r for r in traffic.requests if r[0] == dead and not r[3]]
    return {
        "survivors_p50_s": [round(pct(before, 0.5), 4), round(pct(after, 0.5), 4)],
        "survivors_p99_s": [round(pct(before, 0.99), 4), round(pct(after, 0.99), 4)],
        "survivors_answered": [len(before), len(after)],
        "survivors_failed": sum(not r[3] for r in survivors),
        "dead_failed_in_flight": sum(r[1] < killed_at for r in on_dead),
        "dead_refused_after": sum(r[1] >= killed_at for r in on_dead),
    }


async def failover_run(shape: Shape, folder: Path, store_url: str, before_s: float, after_s: float) -> dict[str, Any]:
    """The replicas launch the workers; traffic; the leader killed; the figures."""
    log_dir = folder / "workers"
    traffic = Traffic()
    try:
        text = functools.partial(policy, shape, store_url=store_url, log_dir=log_dir)
        with replicas(folder, shape.replicas, text) as procs:
            async with aiohttp.ClientSession() as session:
                fleet = await settled(session, procs, shape)
                worker_urls = [w["url"] for w in fleet.workers.values()]
                async with loaded(fleet.urls, worker_urls, shape, traffic):
                    await asyncio.sleep(before_s)
                    taken = await kill_leader(session, fleet)
                    await asyncio.sleep(after_s)
                after = (await roles(session, [fleet.urls[taken["new_leader"]]]))[fleet.urls[taken["new_leader"]]]
    finally:
        stop_leased_workers(log_dir)
    return {
        **{k: v for k, v in taken.items() if k != "killed_at"},
        "pids_before": {wid: w["pid"] for wid, w in fleet.workers.items()},
        "pids_after": {wid: w["pid"] for wid, w in after["workers"].items()},
        **latency_report(traffic, taken["killed_at"], fleet.leader),
        "queue": queue_report(traffic, shape.band),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtests failover", description=__doc__)
    ap.add_argument("--seconds", type=float, default=20.0, help="traffic per pacing arm")
    ap.add_argument("--before", type=float, default=10.0, help="seconds of traffic before the kill")
    ap.add_argument("--after", type=float, default=20.0, help="seconds of traffic after the kill")
    ap.add_argument("--parts", nargs="+", default=["pacing", "failover"], choices=["pacing", "failover"])
    ap.add_argument("--burst", type=int, default=Shape().burst)
    ap.add_argument("--json", help="write the report here")
    return ap


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.harness.postgres import local_postgres

    shape = Shape(burst=args.burst)
    report: dict[str, Any] = {"shape": dataclasses.asdict(shape)}
    with tempfile.TemporaryDirectory(prefix="pacer-failover-") as tmp, local_postgres() as server:
        if "pacing" in args.parts:
            report["pacing"] = {}
            for arm in ("alone", "share"):
                url = server.create_database(f"pacing_{arm}") if arm == "share" else ""
                report["pacing"][arm] = await pacing_arm(shape, Path(tmp) / arm, url, args.seconds)
                print(f"pacing {arm}: {json.dumps(report['pacing'][arm])}", file=sys.stderr)
        if "failover" in args.parts:
            url = server.create_database("failover")
            report["failover"] = await failover_run(shape, Path(tmp) / "failover", url, args.before, args.after)
            print(f"failover: {json.dumps(report['failover'])}", file=sys.stderr)
    return report


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


__all__ = ["Shape", "failover_run", "main", "pacing_arm"]
