"""The request path's own context: what :func:`proxy.request.relay.forward` needs, and nothing of
the front door.

:class:`RequestPath` owns each pool's dispatcher (queue, gate, attempts), the upstream connections to the
workers, the session that posts aborts, the rid counter and the background tasks (aborts), with
the few settings the relay reads, and the workers' engine, which says what a request must carry for
the worker's own scheduler to put interactive work before batch work (:meth:`RequestPath.priority_fields`). The front door's ``ProxyState`` holds one; the composition root
builds it, and opens it (:meth:`RequestPath.open`) and closes it with the app.

The metrics it counts are a :class:`RequestMetrics` seam (the front door's Prometheus registry
implements it), so this package does not depend on how they are exported.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from proxy.engines.contract import Engine
from proxy.errors import ApiError, model_not_found
from proxy.policy import Policy
from proxy.request.dispatch import Dispatcher
from proxy.request.limits import KeyLimiter
from proxy.request.pacing import LoadBoard
from proxy.request.upstream import UpstreamPool
from proxy.workers.base import WorkerId, WorkerPool

__all__ = ["Counter", "Histogram", "RequestMetrics", "RequestPath", "RequestSettings"]

_NO_FIELDS: Mapping[str, object] = {}


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class RequestMetrics(Protocol):
    """What the request path counts, each request once (``proxy.server.metrics.ProxyMetrics``)."""

    @property
    def admitted(self) -> Counter: ...
    @property
    def reject_full(self) -> Counter: ...
    @property
    def reject_rate_limited(self) -> Counter: ...
    @property
    def reject_no_worker(self) -> Counter: ...
    @property
    def retried(self) -> Counter: ...
    @property
    def requeued(self) -> Counter: ...
    @property
    def completed(self) -> Counter: ...
    @property
    def disconnected(self) -> Counter: ...
    @property
    def fail_pushed_out(self) -> Counter: ...
    @property
    def fail_no_worker(self) -> Counter: ...
    @property
    def fail_timeout(self) -> Counter: ...
    @property
    def fail_upstream(self) -> Counter: ...
    @property
    def fail_midstream(self) -> Counter: ...
    @property
    def continued(self) -> Counter: ...
    @property
    def budget_redone(self) -> Counter: ...
    @property
    def queue_time(self) -> Histogram: ...
    @property
    def added_latency(self) -> Histogram: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSettings:
    """The policy's figures the relay reads."""

    request_timeout_s: float  # one upstream attempt, from the POST to the last byte
    queue_timeout_s: float  # longest wait in the proxy queue
    retry_after_s: int  # the Retry-After of a 429 (queue full), a 503 (queue timeout, shutdown)
    default_max_tokens: int = 256  # a request's completion tokens when it does not say (its cost estimate)

    @classmethod
    def from_policy(cls, policy: Policy) -> RequestSettings:
        return cls(
            request_timeout_s=policy.proxy.request_timeout_s,
            queue_timeout_s=policy.queue.timeout_s,
            retry_after_s=policy.queue.retry_after_s,
            default_max_tokens=policy.admission.default_max_tokens,
        )


@dataclass(eq=False)
class RequestPath:
    """``pools`` has each pool's dispatcher (its own queue and gate over its own workers),
    ``pool_metrics`` what is counted of its requests and ``models`` the pool serving each declared
    model; with one pool, every request and every worker is its."""

    settings: RequestSettings
    pool: WorkerPool
    board: LoadBoard  # every worker's load, across the pools (each dispatcher's board)
    pools: Mapping[str, Dispatcher]  # pool name -> its dispatcher, each pool
    pool_metrics: Mapping[str, RequestMetrics]  # pool name -> its counts, each pool
    models: Mapping[str, str] = field(default_factory=dict)  # declared model -> the pool serving it
    limits: KeyLimiter = field(default_factory=lambda: KeyLimiter({}))  # per-key rate limits
    upstream: UpstreamPool | None = None  # the connections to the workers, while open
    session: aiohttp.ClientSession | None = None  # posts aborts, while open
    engines: Mapping[str, Engine] = field(default_factory=dict)  # pool name -> its workers' engine
    _rid_prefix: str = field(default_factory=lambda: "pacer-" + secrets.token_hex(4) + "-")
    _rid_counter: itertools.count[int] = field(default_factory=itertools.count)
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def open(self, session: aiohttp.ClientSession) -> None:
        """The app starts serving: connections to the workers open, aborts go through ``session``."""
        self.session = session
        self.upstream = UpstreamPool()

    def stop_admitting(self) -> int:
        """Shutting down: no request is dispatched any more; each queued one is refused (its handler
        answers 503). Returns how many were queued (batch lines too)."""
        queued = 0
        for dispatcher in self.dispatchers():
            queued += len(dispatcher.admission)
            dispatcher.close()
        return queued

    def in_flight(self) -> int:
        """Requests on a worker now (batch lines too)."""
        return self.board.total_in_flight()

    def end_in_flight(self) -> int:
        """Shutting down, past the grace: end every request still on a worker. Its answer's reader
        gets :class:`~proxy.request.upstream.UpstreamEnded`, so a stream ends with an error event and a
        request with no output yet gets a 503 (the relay's); no new request leaves for a worker.
        Returns how many were ended."""
        return self.upstream.end_in_flight("the proxy is shutting down") if self.upstream is not None else 0

    async def close(self) -> None:
        """The app stopped: wait for the background tasks, close the idle connections."""
        await self.wait_background()
        if self.upstream is not None:
            self.upstream.close()

    def pool_for(self, model: str | None) -> str:
        """The pool serving ``model``: the one declaring it; with one pool, that pool. With several
        pools (each declares its model), no model is a 400 and any other a 404, naming the served ones
        (the front door asks first; a batch line naming a model no longer served gets it here)."""
        pool = self.models.get(model) if model is not None else None
        if pool is None and len(self.pools) == 1:
            pool = next(iter(self.pools))
        if pool is not None:
            return pool
        if model is not None:
            raise model_not_found(model, self.models)
        served = ", ".join(sorted(self.models))
        raise ApiError(
            400,
            f"'model' is required: this proxy serves several models: {served}",
            param="model",
            code="model_required",
        )

    def dispatcher_for(self, model: str | None) -> Dispatcher:
        """The dispatcher of the pool serving ``model`` (:meth:`pool_for`)."""
        return self.pools[self.pool_for(model)]

    def metrics_for(self, model: str | None) -> RequestMetrics:
        """What is counted of ``model``'s requests (:meth:`pool_for`)."""
        return self.pool_metrics[self.pool_for(model)]

    def dispatcher_of(self, pool: str) -> Dispatcher:
        """The dispatcher of the pool named ``pool``; with one pool, of every worker."""
        return next(iter(self.pools.values())) if len(self.pools) == 1 else self.pools[pool]

    def dispatchers(self) -> list[Dispatcher]:
        return list(self.pools.values())

    def priority_fields(self, worker_id: WorkerId, *, interactive: bool) -> Mapping[str, object]:
        """Body fields that put the request's class in the worker's own queue order (empty unless the
        worker's arguments turn the engine's priority scheduling on)."""
        info = self.pool.get(worker_id)
        engine = self.engines.get(info.pool)
        if engine is None:
            return _NO_FIELDS
        return engine.priority_fields(info.args, interactive=interactive)

    def engine_of(self, worker_id: WorkerId) -> Engine | None:
        """The engine of ``worker_id``'s pool (None: not known)."""
        return self.engines.get(self.pool.get(worker_id).pool)

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
