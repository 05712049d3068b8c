"""The front door's harness: a whole proxy (``build_app`` on a real port) in front of in-process
fake engines (:class:`~tests.harness.fake_engine.FakeEngine`) on a hand-set
:class:`~tests.harness.static_pool.StaticPool`; the ``make_proxy`` fixture builds one per call and
stops all of them after the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.server.state import PROXY, ProxyState
from tests.harness.fake_engine import FakeEngine
from tests.harness.static_pool import StaticPool
from tests.harness.wait import wait_until


class Harness:
    def __init__(
        self, url: str, state: ProxyState, workers: list[FakeEngine], pool: StaticPool, runner: web.AppRunner
    ) -> None:
        self.url = url
        self.state = state
        self.workers = workers
        self.pool = pool
        self.runner = runner

    async def stop(self) -> None:
        """Stop the proxy as a signal does (its drain, then its lifecycles), before the test ends."""
        await _cleanup(self.runner)

    def client(self, api_key: str = "none", **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30, **kw)


async def _cleanup(runner: web.AppRunner) -> None:
    if runner.server is not None:  # not stopped by the test already
        await runner.cleanup()


@pytest.fixture
async def make_proxy(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await make_proxy(n_workers=2, policy={...}, worker={...})`` -> Harness (all torn down after)."""
    cleanups: list[Callable[[], Any]] = []

    async def make(
        n_workers: int = 1,
        policy: dict | None = None,
        worker: dict | None = None,
        env: dict | None = None,
        monkeypatch: pytest.MonkeyPatch | None = None,
    ) -> Harness:
        workers = [FakeEngine(**(worker or {})) for _ in range(n_workers)]
        urls = [await w.start() for w in workers]
        cleanups.extend(w.stop for w in workers)
        doc: dict[str, Any] = {
            "engine": {"kind": "external", "urls": urls},
            "pacing": {"queue_band": [2, 8], "headroom": 0, "scrape_interval_s": 0.05, "stale_after_s": 1.0},
            "batch": {"dir": str(tmp_path / "batches")},  # never the batches of a proxy run from this directory
        }
        for section, values in (policy or {}).items():
            doc.setdefault(section, {}).update(values)
        pol = parse_policy(doc, "<test>")
        pool = StaticPool(urls)
        app = build_app(pol, pool)
        runner, port = await serve(app, "127.0.0.1", 0)
        cleanups.append(lambda: _cleanup(runner))
        h = Harness(f"http://127.0.0.1:{port}", app[PROXY], workers, pool, runner)
        await wait_until(
            lambda: all(h.state.board.get(w.id).sample is not None for w in pool.workers()),
            "a first sample of every worker",
        )
        return h

    yield make
    for fn in reversed(cleanups):
        await fn()
