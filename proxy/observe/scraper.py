"""Reads each READY worker's load every ``scrape_interval_s`` and publishes it on the load board.

The interval is in the engine's seconds, as every other timing of the controller: a worker whose
clock runs ``clock_rate`` engine seconds per wall second (a simulated one's time scale) is read that
many times as often, so the fast tier sees it at the same modelled moments as it would a GPU's. A
read costs the proxy CPU, so the wall interval never goes below :data:`MIN_WALL_INTERVAL_S`.

``GET /metrics`` is parsed by the engine the workers speak (:meth:`Engine.parse_metrics`); a worker
that answers 404 there (metrics not enabled) is read from the engine's JSON load endpoint instead
(:attr:`Engine.loads_path`), where it has one.
A garbage page, a non-200 answer, a timeout or an unreachable worker is published as an error:
the worker's sample goes stale (the dispatcher treats it as saturated), the loop never dies.

One aiohttp session is shared with the request path. A worker is never scraped twice at once;
:meth:`Scraper.kick` starts a round at once (used when a worker becomes READY). Cancelling
:meth:`Scraper.run` ends it even when a kick comes at the same moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from proxy.engines.base import Sample
from proxy.engines.contract import Engine
from proxy.request.pacing import LoadBoard
from proxy.workers.base import WorkerId, WorkerInfo, WorkerPool, WorkerState

_log = logging.getLogger(__name__)

# The shortest wall time between two rounds: a round costs the proxy about a millisecond of CPU per
# worker (the page's parse and the fast tier's look), so 20 rounds a second stay within a few percent
# of a core for a few workers, whatever a simulated worker's time scale asks.
MIN_WALL_INTERVAL_S = 0.05


class Scraper:
    def __init__(
        self,
        pool: WorkerPool,
        board: LoadBoard,
        session: aiohttp.ClientSession,
        *,
        engine: Engine,
        interval_s: float,
        timeout_s: float,
        on_result: Callable[[WorkerId, Sample | None, str | None], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        clock_rate: float = 1.0,
    ) -> None:
        self.pool = pool
        self.board = board
        self.session = session
        self.interval_s = interval_s  # in the engine's seconds
        self.clock_rate = clock_rate  # engine seconds per wall second (set again from a worker's server info)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_result = on_result
        self.clock = clock
        self.engine = engine
        self._busy: set[WorkerId] = set()
        self._use_loads: set[WorkerId] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._kick = asyncio.Event()
        self.rounds = 0

    @property
    def wall_interval_s(self) -> float:
        """The wall seconds between two rounds: ``interval_s`` on the workers' clock, at least
        :data:`MIN_WALL_INTERVAL_S`."""
        return max(MIN_WALL_INTERVAL_S, self.interval_s / self.clock_rate)

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        """Scrape rounds until cancelled."""
        try:
            while True:
                self._round()
                self._kick.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
                # lands as the kick is set (a worker turning READY as the proxy stops), and the loop
                # would then run on with the app's cleanup waiting for it
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.wall_interval_s):
                        await self._kick.wait()
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    def _round(self) -> None:
        self.rounds += 1
        for info in self.pool.workers():
            if info.state is WorkerState.READY and info.id not in self._busy:
                self._busy.add(info.id)
                task = asyncio.create_task(self._scrape_guarded(info))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _scrape_guarded(self, info: WorkerInfo) -> None:
        try:
            sample, error = await self.scrape(info)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in a parser must not stop the scraper
            sample, error = None, f"scrape failed: {exc!r}"
        finally:
            self._busy.discard(info.id)
        if error is not None:
            _log.debug("scrape of %s (%s) failed: %s", info.id, info.url, error)
        self.board.publish(info.id, sample, error)
        if self.on_result is not None:
            self.on_result(info.id, sample, error)

    async def scrape(self, info: WorkerInfo) -> tuple[Sample | None, str | None]:
        """One scrape of one worker: (sample, None) or (None, what went wrong)."""
        self.board.get(info.id).scrape_started()
        loads_path = self.engine.loads_path
        use_loads = loads_path is not None and info.id in self._use_loads
        path = loads_path if use_loads and loads_path is not None else "/metrics"
        try:
            async with self.session.get(info.url + path, timeout=self.timeout) as resp:
                if resp.status == 404 and not use_loads and loads_path is not None:
                    self._use_loads.add(info.id)
                    return None, f"{path} answered 404 (metrics not enabled?); reading {loads_path} from now on"
                if resp.status != 200:
                    return None, f"{path} answered HTTP {resp.status}"
                if use_loads:
                    payload = await resp.json(content_type=None)
                    text = None
                else:
                    text = await resp.text()
        except (aiohttp.ClientError, OSError) as exc:
            return None, f"{path} unreachable: {exc.__class__.__name__}: {exc}"
        except TimeoutError:
            return None, f"{path} timed out after {self.timeout.total:g} s"
        except ValueError as exc:
            return None, f"{path} is not JSON: {exc}"
        now = self.clock()
        try:
            if text is not None:
                return self.engine.parse_metrics(text, now), None
            if not isinstance(payload, dict):
                return None, f"{path}: expected a JSON object, got {type(payload).__name__}"
            return self.engine.parse_loads(payload, now), None
        except ValueError as exc:
            return None, f"{path}: {exc}"
