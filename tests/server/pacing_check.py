"""Drive a proxy with many requests at once and sample each worker's own ``/metrics`` meanwhile."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import aiohttp

_QUEUE = re.compile(r"^sglang:num_queue_reqs(?:\{[^}]*\})?\s+([0-9.e+]+)", re.M)


@dataclass
class PacingRun:
    statuses: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    samples: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)  # url -> (t, queue, proxy backlog)


async def run_burst(
    proxy_url: str,
    worker_urls: list[str],
    n: int,
    body: dict | callable,
    *,
    backlog: callable,
    sample_every_s: float = 0.02,
    concurrency: int = 4000,
) -> PacingRun:
    run = PacingRun(samples={u: [] for u in worker_urls})
    done = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def one(i: int) -> None:
            payload = body(i) if callable(body) else body
            async with s.post(proxy_url + "/v1/completions", json={**payload, "prompt": f"request {i}"}) as r:
                payload = await r.json(content_type=None)
                run.statuses.append(r.status)
                if r.status == 200:
                    run.ids.append(payload["choices"][0]["text"] + "|" + str(i))

        async def sampler() -> None:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while not done.is_set():
                for u in worker_urls:
                    async with s.get(u + "/metrics") as r:
                        m = _QUEUE.search(await r.text())
                    if m:
                        run.samples[u].append((loop.time() - t0, int(float(m.group(1))), backlog()))
                await asyncio.sleep(sample_every_s)  # a sampling cadence while the load runs, not a wait

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(one(i) for i in range(n)))
        done.set()
        await sampling
    return run


def band_report(run: PacingRun, lo: int, hi: int, min_backlog: int) -> dict[str, tuple[int, int, int, int]]:
    """Per worker: (samples while the proxy held a backlog, max queue, samples below lo, samples above hi).

    Only samples taken after the worker's queue first reached ``lo`` and while the proxy queue held
    at least ``min_backlog`` requests count: before that the band is being filled, after it the
    work is running out.
    """
    out = {}
    for url, samples in run.samples.items():
        started = False
        kept = []
        for _, q, backlog in samples:
            started = started or q >= lo
            if started and backlog >= min_backlog:
                kept.append(q)
        out[url] = (len(kept), max(kept, default=0), sum(q < lo for q in kept), sum(q > hi for q in kept))
    return out
