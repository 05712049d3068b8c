"""The dashboard in a real headless browser, in front of the whole proxy and a ``pacer sim`` worker:
the page loads without console errors, its curves move under load, and after the controller
restarts a worker (an operator's trial on one of two, as ``pacer try`` asks it) the decision is a
mark on the timeline and a row in the table. A screenshot is kept as the test's artifact."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from tests.control.e2e import MODEL, running_proxy
from tests.dashboard.browser import browser_page
from tests.harness.wait import wait_until

pytestmark = [pytest.mark.long]

N_REQUESTS = 300
MAX_TOKENS = 1000


async def test_dashboard_shows_load_and_a_restart(tmp_path: Path) -> None:
    rnd = random.Random(3)
    outputs = [rnd.randint(100, MAX_TOKENS) for _ in range(N_REQUESTS)]
    async with running_proxy(
        tmp_path,
        args={"schedule_conservativeness": 0.1, "max_total_tokens": 30000, "max_running_requests": 256},
        extra_args=["--sim-time-scale", "5"],
        control={"mode": "auto", "restarts_per_hour": 0, "drain_timeout_s": 3, "available_mem_band_gb": [0.5, 80]},
        workers=2,
    ) as proxy, browser_page() as bp:  # fmt: skip
        page = bp.page
        await page.goto(proxy.url + "/dashboard")
        await page.wait_for_function("window.pacer && window.pacer.polls >= 2", timeout=15000)
        assert await page.locator(".uplot").count() >= 5  # four charts per worker and the proxy's
        idle_running = await page.evaluate("Math.max(0, ...window.pacer.data.workers[0].series.running)")
        assert idle_running == 0

        worker = proxy.state.pool.workers()[0].id
        first_pid = proxy.state.pool.get(worker).pid
        client = proxy.client()
        sem = asyncio.Semaphore(200)

        async def one(i: int) -> int:
            async with sem:
                r = await client.completions.create(
                    model=MODEL, prompt=f"request {i}: a story about {i}", max_tokens=MAX_TOKENS,
                    extra_body={"sim_output_len": outputs[i]},
                )  # fmt: skip
                return r.usage.completion_tokens

        tasks = [asyncio.ensure_future(one(i)) for i in range(N_REQUESTS)]
        try:
            # the curves move: the page's own data shows a running batch and a queue
            await page.wait_for_function(
                "Math.max(0, ...window.pacer.data.workers[0].series.running) > 0"
                " && Math.max(0, ...window.pacer.data.workers[0].series.token_usage) > 0.1",
                timeout=30000,
            )
            async with aiohttp.ClientSession() as s:
                trial = {"worker": worker, "args": {"schedule_conservativeness": 0.5}}
                async with s.post(proxy.url + "/admin/trial", json=trial) as r:
                    assert r.status == 202, await r.text()
            await wait_until(lambda: proxy.state.pool.get(worker).pid != first_pid, "a restart", timeout=90)
            await page.wait_for_function("Number(document.body.dataset.marks) >= 1", timeout=15000)
            row = page.locator('tr.decision[data-rule="operator_trial"]').first
            await row.wait_for(timeout=15000)
            assert "schedule_conservativeness 0.1" in await row.inner_text()
            await page.wait_for_function(
                "window.pacer.data.workers[0].args.schedule_conservativeness > 0.1", timeout=30000
            )
            await page.wait_for_function("window.pacer.data.workers[0].state === 'ready'", timeout=30000)
            done = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
        assert done == outputs  # nothing lost while the page watched
        polls = await page.evaluate("window.pacer.polls")
        await page.wait_for_function(f"window.pacer.polls > {polls}", timeout=15000)  # the curves after the restart
        shot = tmp_path / "dashboard.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert "applied" in await page.locator("#decisions").inner_text()
        assert await page.locator("#worker-w0 .args").inner_text() != "(no args)"
        assert bp.console_errors == []
        print(f"screenshot: {shot}")
