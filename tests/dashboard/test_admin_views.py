"""``/dashboard``, ``/admin/timeline``, ``pacer status`` and ``pacer decisions`` against a real
front door (two external workers nobody answers for, a journal with entries, an admin key)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy import cli
from proxy.compose import build_app, serve
from proxy.control.decision import Decision
from proxy.control.journal import Status
from proxy.policy import ControlMode, parse_policy
from proxy.server.state import PROXY
from tests.harness.static_pool import StaticPool

KEY = "sesame"


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[tuple[str, Any]]:
    monkeypatch.setenv("PACER_TEST_ADMIN", KEY)
    policy = parse_policy({
        "engine": {"kind": "external", "urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"]},
        "auth": {"admin_key_env": "PACER_TEST_ADMIN"},
        "control": {"mode": "advise", "journal_path": None},
        "batch": {"dir": str(tmp_path / "batches")},
    }, "<test>")  # fmt: skip
    app = build_app(policy, StaticPool(list(policy.engine.urls)))
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        journal = app[PROXY].journal
        for worker, rule, status in (("w0", "retraction_storm", Status.ADVISED), ("w1", "memory_headroom", Status.REFUSED),
                                     ("w0", "admission_too_conservative", Status.ADVISED)):  # fmt: skip
            journal.record(
                Decision(worker_id=worker, rule=rule, reason=f"because {rule}", time=1.0,
                         old_args={"schedule_conservativeness": 1.0}, new_args={"schedule_conservativeness": 0.4}),
                mode=ControlMode.ADVISE, status=status,
            )  # fmt: skip
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def get(url: str, key: str | None = KEY) -> tuple[int, bytes, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.read(), r.content_type


async def test_page_and_its_files_are_served_from_the_package(proxy: tuple[str, Any]) -> None:
    url, _ = proxy
    status, body, ctype = await get(url + "/dashboard", key=None)  # the page holds no data: open
    assert status == 200 and ctype == "text/html"
    assert b"uPlot.iife.min.js" in body
    for path in ("dashboard.js", "dashboard.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"):
        status, body, _ = await get(f"{url}/dashboard/static/{path}", key=None)
        assert status == 200 and len(body) > 500, path
    status, body, _ = await get(url + "/dashboard/static/../routes.py", key=None)
    assert status == 404 or b"add_routes" not in body


async def test_timeline_needs_the_admin_key_and_has_every_part(proxy: tuple[str, Any]) -> None:
    url, _ = proxy
    status, body, _ = await get(url + "/admin/timeline", key=None)
    assert status == 401 and "admin key" in orjson.loads(body)["error"]["message"]
    for bad in ("nope", "inf", "0"):
        status, body, _ = await get(url + f"/admin/timeline?window_s={bad}")
        assert status == 400 and orjson.loads(body)["error"]["param"] == "window_s", bad
    status, body, _ = await get(url + "/admin/timeline?window_s=60")
    assert status == 200
    t = orjson.loads(body)
    assert t["mode"] == "advise" and t["band"] == [100, 2000] and t["window_s"] == 60
    assert [w["id"] for w in t["workers"]] == ["w0", "w1"]
    w0 = t["workers"][0]
    assert set(w0) >= {"id", "pool", "url", "state", "args", "series", "restarts", "managed"}
    assert set(w0["series"]) == {"t", "queue", "running", "token_usage", "gen_throughput", "retractions_per_min",
                                 "in_flight"}  # fmt: skip
    assert "t" in t["proxy"] and "in_flight" in t["proxy"]
    rules = [d["rule"] for d in t["decisions"]]
    assert rules == ["retraction_storm", "memory_headroom", "admission_too_conservative"]
    assert all(abs(d["t"] - t["now"]) < 60 for d in t["decisions"])  # epoch seconds, for the time axis


async def pacer(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def pacer_in_process(*args: str) -> tuple[int, str, str]:
    """``pacer ARGS`` through the same entry point, in this process: no interpreter to start for each
    variant of a command that one :func:`pacer` run has shown working as a process. In a thread, since
    its HTTP calls block and the proxy answering them runs on this loop."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                return cli.main(list(args))
            except SystemExit as exc:  # argparse's refusal of an argument
                return exc.code if isinstance(exc.code, int) else 1

    code = await asyncio.wait_for(asyncio.to_thread(run), 30)
    return code, out.getvalue(), err.getvalue()


async def test_pacer_status(proxy: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = proxy
    rc, out, err = await pacer("status", "--url", url, "--admin-key", KEY)  # as a process, as an operator runs it
    assert rc == 0, err
    assert "controller advise" in out and "proxy queue interactive 0, batch 0" in out
    assert "w0 " in out and "w1 " in out and "http://127.0.0.1:9" in out
    assert "last decisions (3 shown)" in out and "admission_too_conservative [advised]" in out
    # the other cases through the same entry point in this process
    rc, out, err = await pacer_in_process("status", "--url", url)
    assert rc == 1 and "401" in err and "admin key" in err
    monkeypatch.setenv("PACER_ADMIN_KEY", KEY)
    rc, out, err = await pacer_in_process("status", "--url", url)  # the key from the env
    assert rc == 0 and "w1" in out
    rc, out, err = await pacer_in_process("status", "--url", "http://127.0.0.1:9")
    assert rc == 1 and "cannot reach the proxy" in err


async def test_pacer_decisions_filters(proxy: tuple[str, Any]) -> None:
    url, _ = proxy
    base = ("decisions", "--url", url, "--admin-key", KEY)
    rc, out, _ = await pacer(*base)  # as a process, as an operator runs it
    assert rc == 0 and "3 decision(s)" in out and "schedule_conservativeness 1.0 -> 0.4" in out
    # the filters, through the same entry point in this process
    rc, out, _ = await pacer_in_process(*base)
    assert rc == 0 and "3 decision(s)" in out and "schedule_conservativeness 1.0 -> 0.4" in out
    rc, out, _ = await pacer_in_process(*base, "--worker", "w0", "--json")
    entries = [orjson.loads(line) for line in out.splitlines()]
    assert [e["rule"] for e in entries] == ["retraction_storm", "admission_too_conservative"]
    rc, out, _ = await pacer_in_process(*base, "--status", "refused", "--json")
    assert [orjson.loads(line)["worker"] for line in out.splitlines()] == ["w1"]
    rc, out, _ = await pacer_in_process(*base, "--rule", "retraction_storm", "--since", "10m", "--json")
    assert len(out.splitlines()) == 1
    rc, out, _ = await pacer_in_process(*base, "--since", "2999-01-01T00:00:00", "--json")
    assert rc == 0 and out == ""
    rc, out, _ = await pacer_in_process(*base, "--limit", "1", "--json")
    assert [orjson.loads(line)["rule"] for line in out.splitlines()] == ["admission_too_conservative"]
    rc, _, err = await pacer_in_process(*base, "--since", "yesterday")
    assert rc == 2 and "--since" in err


async def test_the_page_asks_for_the_admin_key_then_shows_the_proxy(proxy: tuple[str, Any]) -> None:
    from tests.dashboard.browser import browser_page

    url, _ = proxy
    async with browser_page() as bp:
        page = bp.page
        await page.goto(url + "/dashboard")
        await page.locator("#keyform").wait_for(state="visible", timeout=10000)
        assert await page.locator("#summary").inner_text() == "admin key needed"
        await page.fill("#key", KEY)
        await page.click("#keyform button")
        await page.wait_for_function("window.pacer.polls >= 1", timeout=10000)
        assert await page.locator("tr.decision").count() == 3
        assert await page.locator("#worker-w1").count() == 1
        assert "controller advise" in await page.locator("#summary").inner_text()
        # the 401 the browser logs for the first, keyless poll is the only console error
        assert all("401" in e for e in bp.console_errors), bp.console_errors


async def test_pacer_status_watch_redraws_until_stopped(proxy: tuple[str, Any]) -> None:
    url, _ = proxy
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "status", "--url", url, "--admin-key", KEY, "--watch", "--interval", "0.2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = 0
    try:
        while seen < 3:
            line = await asyncio.wait_for(proc.stdout.readline(), 15)
            assert line, "pacer status --watch exited"
            seen += line.startswith(b"controller advise")
    finally:
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 15)
    assert rc == 0  # Ctrl-C ends the watch cleanly
