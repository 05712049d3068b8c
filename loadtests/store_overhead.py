"""The Batch API store's cost per line, SQLite vs a shared PostgreSQL:
``python -m loadtests store [--lines N] [--concurrency C] [--repeats R] [--report FILE.json]``.

One :class:`~proxy.batch.BatchService` per backend, with an executor that answers every line at once
(no engine, no proxy request path): what is left of a line's time is the runner and the store (claim,
record with its counters, the output file built at the end). Each repeat uploads a file of ``--lines``
chat requests, creates a batch and times it from ``batches.create`` to ``completed``; the figure is
the median over the repeats, per line, and PostgreSQL's excess over SQLite.

SQLite as the proxy opens it (WAL, ``synchronous=NORMAL``); PostgreSQL as Debian ships it (``fsync`` and
``synchronous_commit`` on: each commit waits for its WAL flush), started for the run in a temporary
directory on this host (``tests.harness.postgres``) and reached over TCP on 127.0.0.1: a server on
another host adds its network round trips. The machine's load average is printed with the figures:
on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from proxy.batch import BatchService, LineResult, owner_of

OWNER = owner_of("bench")
ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
    }
)


class InstantExecutor:
    async def execute(self, endpoint: str, body: dict[str, Any], owner: str, withdraw: asyncio.Event) -> LineResult:
        return LineResult(200, ANSWER, "req-bench")


def _lines(n: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 16}
    return b"".join(
        orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n"
        for i in range(n)
    )


async def _one(chunks: AsyncIterator[bytes], service: BatchService) -> float:
    """Seconds from ``batches.create`` to ``completed`` for one batch of the uploaded lines."""
    uploaded = await service.upload_file(OWNER, filename="in.jsonl", purpose="batch", chunks=chunks)
    start = time.perf_counter()
    batch = await service.create_batch(
        OWNER, input_file_id=uploaded["id"], endpoint="/v1/chat/completions", completion_window="24h"
    )
    while (await service.get_batch(OWNER, batch["id"]))["status"] not in ("completed", "failed", "expired"):
        await asyncio.sleep(0.02)
    done = await service.get_batch(OWNER, batch["id"])
    if done["status"] != "completed" or done["request_counts"]["completed"] != done["request_counts"]["total"]:
        raise RuntimeError(f"the batch did not complete: {done['status']} {done['request_counts']}")
    return time.perf_counter() - start


async def _backend(url: str, data: bytes, args: argparse.Namespace) -> list[float]:
    async def chunks() -> AsyncIterator[bytes]:
        yield data

    with tempfile.TemporaryDirectory(prefix="pacer-store-bench-") as folder:
        async with BatchService.open(
            Path(folder), InstantExecutor(), concurrency=args.concurrency, store_url=url
        ) as service:
            return [await _one(chunks(), service) for _ in range(args.repeats)]


def run(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    from tests.harness.postgres import local_postgres

    data = _lines(args.lines)
    load_before = os.getloadavg()
    with local_postgres(durable=True) as server:
        url = server.create_database("bench")
        timings = {
            "sqlite": asyncio.run(_backend("", data, args)),
            "postgresql": asyncio.run(_backend(url, data, args)),
        }
    per_line_ms = {name: statistics.median(t) / args.lines * 1000 for name, t in timings.items()}
    report = {
        "lines": args.lines,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "seconds": timings,
        "per_line_ms": per_line_ms,
        "postgresql_excess_per_line_ms": per_line_ms["postgresql"] - per_line_ms["sqlite"],
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    for name, ms in per_line_ms.items():
        say(f"{name:11s} {ms:.3f} ms a line (median of {args.repeats} batches of {args.lines})")
    say(f"postgresql adds {report['postgresql_excess_per_line_ms']:.3f} ms a line")
    say(f"load average {load_before[0]:.1f} before, {report['loadavg_after'][0]:.1f} after, {os.cpu_count()} CPUs")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests store", description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=2000, help="lines per batch")
    p.add_argument("--concurrency", type=int, default=64, help="the runner's lines in flight (batch.concurrency)")
    p.add_argument("--repeats", type=int, default=3, help="batches per backend; the median counts")
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
