"""The pacing test: over a thousand requests at once through a real ``pacer serve`` process in front
of two ``pacer sim`` workers; each worker's own ``/metrics`` is sampled meanwhile.

Tolerance held: while the proxy still holds a backlog (at least 100 requests queued) and after a
worker's queue first reached the band's lower edge, every sample of ``#queue-req`` is <= the upper
edge, and at most 25% of samples are below the lower edge. Below-edge samples come from refills
that lag completions. The workers run at twice the wall's pace (time scale 2), which the proxy
keeps fed on two busy cores; faster (3 and up), the proxy, two workers and this load generator on
two busy cores cannot carry requests to the workers as fast as they finish them, and a worker's
queue shows the requests in transit as missing. The controller is off: a restart of a worker (a
drain) is not pacing. All requests complete, each exactly once.

Output lengths vary (8..55 tokens), as real traffic does: with identical lengths a whole running
batch finishes in one step and the server moves its entire queue into the batch at once, so any
band narrower than ``max_running_requests`` dips to zero between refills whatever the proxy does.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.harness.serve_process import pacer_serve
from tests.harness.wait import wait_until
from tests.server.pacing_check import band_report, run_burst

LO, HI = 20, 60
N = 1200

POLICY = f"""
[proxy]
host = "127.0.0.1"
status_log_interval_s = 1.0
[queue]
capacity = 10000
timeout_s = 240
[engine]
kind = "sim"
workers = 2
args = {{ max_running_requests = 32 }}
extra_args = ["--sim-time-scale", "2", "--sim-startup-seconds", "0.2"]
log_dir = "logs"
startup_timeout_s = 60
stop_grace_s = 5
[control]
mode = "off"  # what is measured is the pacing: no restart of a worker (a drain) in the middle of the burst
[pacing]
queue_band = [{LO}, {HI}]
headroom = 30
scrape_interval_s = 0.05
stale_after_s = 1.0
"""


@pytest.fixture
def pacer(tmp_path):
    (tmp_path / "policy.toml").write_text(POLICY)
    with pacer_serve(tmp_path, grace_s=20.0) as served:
        yield served


async def _ready(url: str, logfile, timeout: float = 90.0) -> list[dict]:
    async def both_ready() -> list[dict] | None:
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
                workers = (await r.json())["workers"]
        except (aiohttp.ClientError, OSError, ValueError, KeyError):
            return None  # the proxy is not listening yet
        return workers if len(workers) == 2 and all(w["state"] == "ready" and w["sample"] for w in workers) else None

    return await wait_until(
        both_ready, "the proxy and both workers ready and sampled", timeout=timeout, every=0.1,
        detail=lambda: logfile.read_text()[-3000:],
    )  # fmt: skip


async def test_burst_keeps_each_worker_queue_in_band(pacer):
    url, logfile = pacer
    workers = await _ready(url, logfile)
    # the policy's port is 8000; the summary names the one --port gave, which it serves on
    assert f"proxy    listen {url.removeprefix('http://')}," in logfile.read_text()
    backlog = {"n": 0}

    async def watch_backlog(stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                async with s.get(url + "/admin/workers") as r:
                    q = (await r.json())["proxy_queue"]
                backlog["n"] = q["interactive"] + q["batch"]
                await asyncio.sleep(0.02)  # a sampling cadence while the burst runs, not a wait

    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_backlog(stop))
    t0 = time.monotonic()
    run = await run_burst(
        url,
        [w["url"] for w in workers],
        N,
        lambda i: {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "max_tokens": 64,
            "sim_output_len": 8 + (i * 7919) % 48,
        },
        backlog=lambda: backlog["n"],
    )
    elapsed = time.monotonic() - t0
    stop.set()
    await watcher
    report = band_report(run, LO, HI, min_backlog=100)
    print(f"{N} requests in {elapsed:.1f} s; per worker (samples, max #queue-req, below lo, above hi): {report}")
    assert run.statuses.count(200) == N, {s: run.statuses.count(s) for s in set(run.statuses)}
    assert len(set(run.ids)) == N
    # none twice: the workers finished exactly N requests between them
    finished = 0
    async with aiohttp.ClientSession() as s:
        for w in workers:
            async with s.get(w["url"] + "/metrics") as r:
                text = await r.text()
            finished += sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("sglang:num_requests_total")
            )
    assert finished == N
    for _url, (kept, _qmax, below, above) in report.items():
        assert kept >= 20, report
        assert above == 0, report
        assert below <= 0.25 * kept, report
    assert "#proxy-queue" in logfile.read_text()
