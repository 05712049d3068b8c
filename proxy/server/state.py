"""Everything the front door's handlers share, in one typed object stored on the app.

Other parts (the controller, the batch API) reach the request path through it:
``app[PROXY].dispatcher`` (drain / wait_idle / take_back), ``app[PROXY].board`` (per-worker
in-flight counts and latest samples, ``subscribe`` for every scrape) and ``app[PROXY].pool``; ``app[PROXY].gpus.last`` is the newest GPU report (NVML).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.control.controller import Controller
from proxy.control.journal import Journal
from proxy.observe.nvml import GpuWatch
from proxy.observe.scraper import Scraper
from proxy.policy import Policy
from proxy.request.admission import AdmissionQueue
from proxy.request.dispatch import Dispatcher
from proxy.request.pacing import LoadBoard
from proxy.request.upstream import UpstreamPool
from proxy.server.auth import KeyRing
from proxy.server.metrics import ProxyMetrics
from proxy.server.models import ModelCatalog
from proxy.workers.base import WorkerPool


@dataclass(eq=False)
class ProxyState:
    policy: Policy
    pool: WorkerPool
    board: LoadBoard
    admission: AdmissionQueue
    dispatcher: Dispatcher
    metrics: ProxyMetrics
    keys: KeyRing
    models: ModelCatalog
    session: aiohttp.ClientSession | None = None
    scraper: Scraper | None = None
    upstream: UpstreamPool | None = None  # the request path's connections to the workers
    gpus: GpuWatch | None = None  # None when proxy.gpu_sample_interval_s = 0
    controller: Controller | None = None  # set while the app runs (the controller's lifecycle)
    journal: Journal | None = None
    _rid_prefix: str = field(default_factory=lambda: "pacer-" + secrets.token_hex(4) + "-")
    _rid_counter: itertools.count[int] = field(default_factory=itertools.count)
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def new_rid(self) -> str:
        return f"{self._rid_prefix}{next(self._rid_counter)}"

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire and forget, keeping a reference until it ends (aborts, model refreshes)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


PROXY = web.AppKey("proxy", ProxyState)
