"""The scraper over real sockets: good pages become samples; garbage, errors and dead workers
become recorded errors (the sample goes stale), and the loop keeps running."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from proxy.engines.sglang.engine import SGLANG
from proxy.observe.scraper import Scraper
from proxy.request.admission import AdmissionQueue
from proxy.request.pacing import LoadBoard
from proxy.server.status_log import format_status
from tests.harness.static_pool import StaticPool
from tests.harness.wait import wait_until

GOOD = 'sglang:num_queue_reqs{model_name="m"} 7\nsglang:num_running_reqs{model_name="m"} 3\nsglang:token_usage{model_name="m"} 0.42\n'


async def _server(routes: dict[str, web.Response | int]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path, answer in routes.items():

        async def handler(request, answer=answer):
            if isinstance(answer, int):
                return web.Response(status=answer)
            return web.Response(text=answer, content_type="text/plain") if isinstance(answer, str) else answer

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_samples_errors_and_staleness():
    good, url_good = await _server({"/metrics": GOOD})
    bad, url_bad = await _server({"/metrics": "this is { not prometheus"})
    gone, url_gone = await _server({"/metrics": GOOD})
    await gone.cleanup()  # nothing listens there any more
    loads_only, url_loads = await _server(
        {
            "/metrics": 404,
            "/v1/loads": web.json_response(
                {"loads": [{"num_waiting_reqs": 2, "num_running_reqs": 5, "token_usage": 0.5}]}
            ),
        }
    )
    pool = StaticPool([url_good, url_bad, url_gone, url_loads])
    board = LoadBoard()
    seen: list[tuple[str, bool]] = []
    board.subscribe(lambda wid, sample, err: seen.append((wid, sample is not None)))
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(pool, board, session, engine=SGLANG, interval_s=0.05, timeout_s=1.0)
        task = asyncio.ensure_future(scraper.run())
        try:
            await wait_until(
                lambda: board.get("w3").sample is not None and scraper.rounds >= 4, "four rounds, w3 sampled"
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    now = time.monotonic()
    s0 = board.get("w0").sample
    assert s0 is not None and (s0.queue, s0.running, s0.token_usage) == (7, 3, 0.42)
    assert board.get("w0").fresh(now, 1.0)
    assert board.get("w1").sample is None and "not a Prometheus" in board.get("w1").error
    assert board.get("w2").sample is None and "unreachable" in board.get("w2").error
    s3 = board.get("w3").sample
    assert s3 is not None and (s3.queue, s3.running) == (2, 5)  # fell back to /v1/loads after a 404
    assert ("w0", True) in seen and ("w1", False) in seen
    # once a good worker starts failing, its old sample stops counting as fresh
    board.publish("w0", None, "timed out")
    assert not board.get("w0").fresh(now, 1.0)
    line = format_status(AdmissionQueue(10), board, pool.workers(), now, 1.0)
    assert line.startswith("[pacer] #proxy-queue: 0 (interactive 0, batch 0), #in-flight: 0")
    assert "w3: #in-flight: 0, #queue-req: 2, #running-req: 5, token usage: 0.50" in line
    assert "no sample (" in line
    for r in (good, bad, loads_only):
        await r.cleanup()


@pytest.mark.looptime
async def test_cancelling_the_run_ends_it_even_as_a_kick_comes() -> None:
    """The proxy stops as a worker turns READY: the kick and the app's cancel land in the same
    loop turn. The run must end (the app's cleanup awaits it), not swallow the cancel and go on."""
    pool = StaticPool([])  # no READY worker: a round scrapes nothing
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(pool, LoadBoard(), session, engine=SGLANG, interval_s=0.5, timeout_s=1.0)
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(0.1)  # waiting for the next round or a kick
        scraper.kick()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        assert task in done, "the scraper ran on after its cancellation"
        assert task.cancelled()
        rounds = scraper.rounds
        await asyncio.sleep(2.0)  # four of its intervals: no round comes (virtual time)
        assert scraper.rounds == rounds


@pytest.mark.looptime
@pytest.mark.parametrize(("clock_rate", "rounds"), [(1.0, 10), (5.0, 50), (40.0, 100)])
async def test_the_interval_is_on_the_workers_clock_with_a_wall_floor(clock_rate: float, rounds: int) -> None:
    """0.5 engine seconds between rounds: on a worker 5 times faster than the wall, 10 rounds a wall
    second; never more than 20 a wall second (the floor), however fast its clock (virtual time)."""
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(
            StaticPool([]), LoadBoard(), session, engine=SGLANG, interval_s=0.5, timeout_s=1.0, clock_rate=clock_rate
        )
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(5.0 - 1e-6)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert scraper.rounds == rounds
