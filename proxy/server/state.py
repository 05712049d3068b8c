"""Everything the front door's handlers share, in one typed object stored on the app.

Other parts (the controller, the batch API) reach the request path through it:
``app[PROXY].requests`` (:class:`~proxy.request.path.RequestPath`: each pool's dispatcher with its
``wait_idle`` / ``take_back`` hooks, the upstream connections, the background tasks),
``app[PROXY].board`` (per-worker in-flight attempts and latest samples, ``subscribe`` for every
scrape) and ``app[PROXY].pool`` (the one truth of which worker may get requests: its state);
``app[PROXY].gpus.last`` is the newest GPU report (NVML).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.control.controller import Controller
from proxy.control.journal import Journal
from proxy.observe.nvml import GpuWatch
from proxy.observe.scraper import Scraper
from proxy.policy import Policy
from proxy.request.pacing import LoadBoard
from proxy.request.path import RequestPath
from proxy.request.queues import QueueDepth
from proxy.server.auth import KeyRing
from proxy.server.drain import Drain
from proxy.server.metrics import ProxyMetrics
from proxy.server.models import ModelCatalog
from proxy.workers.base import WorkerPool


@dataclass(eq=False)
class ProxyState:
    policy: Policy
    pool: WorkerPool
    board: LoadBoard
    admission: QueueDepth  # every pool's queue (one AdmissionQueue, or QueueTotals over the pools')
    requests: RequestPath
    metrics: ProxyMetrics
    keys: KeyRing
    models: ModelCatalog
    drain: Drain  # the shutdown's first step (proxy.shutdown_grace_s); counts the requests the edge answers
    session: aiohttp.ClientSession | None = None  # scrapes, aborts, model lists and admin calls
    gpus: GpuWatch | None = None  # None when proxy.gpu_sample_interval_s = 0
    journal: Journal | None = None
    controllers: dict[str, Controller] = field(default_factory=dict)  # per pool, while the app runs
    scrapers: dict[str, Scraper] = field(default_factory=dict)  # per pool, while the app runs
    # set once the controllers plan the workers' first launches: the pool starts after it
    launches_planned: asyncio.Event = field(default_factory=asyncio.Event)
    # stops the controllers (idempotent), set while they run: the shutdown's drain calls it first
    stop_control: Callable[[], Awaitable[None]] | None = None

    def control_mode(self) -> str:
        """The controllers' mode: one word when the pools' agree, else each pool's ("a auto, b off")."""
        modes = {p.name: p.control.mode for p in self.policy.pools}
        if len(set(modes.values())) == 1:
            return str(next(iter(modes.values())))
        return ", ".join(f"{name} {mode}" for name, mode in modes.items())

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire and forget (model refreshes), kept with the request path's background tasks."""
        self.requests.spawn(coro)


PROXY = web.AppKey("proxy", ProxyState)
