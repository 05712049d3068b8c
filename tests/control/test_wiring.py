"""``GET /admin/decisions`` on the real front door: the journal, filters, errors, the admin key."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.compose import build_app, serve
from proxy.control.decision import Decision
from proxy.control.journal import Status
from proxy.policy import ControlMode, parse_policy
from proxy.server.state import PROXY
from tests.harness.static_pool import StaticPool


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, object]]:
    monkeypatch.setenv("PACER_TEST_ADMIN", "sesame")
    policy = parse_policy({
        "engine": {"kind": "external", "urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"]},
        "auth": {"admin_key_env": "PACER_TEST_ADMIN"},
        "control": {"mode": "advise", "journal_path": None},
    }, "<test>")  # fmt: skip
    pool = StaticPool(list(policy.engine.urls))
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def get(url: str, key: str | None = "sesame") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.json()


async def test_decisions_endpoint(proxy: tuple[str, object]) -> None:
    url, app = proxy
    status, body = await get(url + "/admin/decisions")
    assert status == 200 and body == {"mode": "advise", "decisions": []}

    journal = app[PROXY].journal
    for worker, rule in (("w0", "retraction_storm"), ("w1", "memory_headroom"), ("w0", "admission_too_conservative")):
        journal.record(Decision(worker_id=worker, rule=rule, reason="r", time=1.0, old_args={"a": 1}, new_args={"a": 2}),
                       mode=ControlMode.ADVISE, status=Status.ADVISED)  # fmt: skip
    status, body = await get(url + "/admin/decisions?worker=w0")
    assert status == 200 and [d["rule"] for d in body["decisions"]] == [
        "retraction_storm",
        "admission_too_conservative",
    ]
    assert body["decisions"][0]["changes"] == {"a": [1, 2]}
    status, body = await get(url + "/admin/decisions?limit=1")
    assert [d["rule"] for d in body["decisions"]] == ["admission_too_conservative"]


@pytest.mark.parametrize("query", ["limit=0", "limit=abc", "limit=-3"])
async def test_bad_limit_is_a_400_naming_it(proxy: tuple[str, object], query: str) -> None:
    status, body = await get(proxy[0] + "/admin/decisions?" + query)
    assert status == 400 and body["error"]["param"] == "limit" and "positive integer" in body["error"]["message"]


async def test_admin_key_required(proxy: tuple[str, object]) -> None:
    status, body = await get(proxy[0] + "/admin/decisions", key=None)
    assert status == 401 and "admin key" in body["error"]["message"]
    status, _ = await get(proxy[0] + "/admin/decisions", key="wrong")
    assert status == 401
