"""The proxy's own Prometheus metrics (``pacer_`` prefix) in a registry of their own.

Implements the request path's :class:`~proxy.request.path.RequestMetrics`, one per pool
(:meth:`ProxyMetrics.of`: what happened to a pool's requests carries its ``pool`` label; a refusal
at the door, before a pool is chosen, does not), its counters plain attributes pre-bound to their
labels. Gauges that mirror live state (queue depth, in-flight, estimated server queue, last sample) are
read at scrape time by a custom collector, so the request path never updates them; so are the GPU
gauges, from the newest NVML report (``gpus``, a callable). Counters and
histograms are pre-bound to their labels where the label set is fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.observe.nvml import GpuReport
from proxy.request.admission import ORDER
from proxy.request.attempt import Requeued
from proxy.request.pacing import LoadBoard
from proxy.request.queues import QueueDepth
from proxy.workers.base import WorkerInfo, WorkerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


GpuSource = Callable[[], GpuReport | None]


def _no_gpu_report() -> GpuReport | None:
    return None


class _LiveState(Collector):
    def __init__(
        self,
        admission: QueueDepth,
        queues: Mapping[str, QueueDepth],
        board: LoadBoard,
        workers: Callable[[], Sequence[WorkerInfo]],
        gpus: GpuSource,
    ) -> None:
        self.admission = admission  # every pool's queue: a key's requests, over the pools
        self.queues = queues  # each pool's
        self.board = board
        self.workers = workers
        self.gpus = gpus

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily(
            "pacer_queue_depth", "Requests waiting in the proxy queue", labels=["pool", "priority"]
        )
        ahead = CounterMetricFamily(
            "pacer_prefix_first_requests",
            "Requests the proxy's queue sent before older ones because their prefix runs on a worker (lpm pools)",
            labels=["pool"],
        )
        for pool, queue in self.queues.items():
            for p in ORDER:
                depth.add_metric([pool, p.value], queue.depth(p))
            ahead.add_metric([pool], queue.sent_ahead)
        yield depth
        yield ahead
        yield from _admission_families(self.admission)
        workers = self.workers()
        urls = {w.id: w.url for w in workers}
        pools = {w.id: w.pool for w in workers}
        yield from _worker_families(workers)
        labels = ["worker", "pool"]
        inflight = GaugeMetricFamily(
            "pacer_inflight", "Requests the proxy has open on each worker", labels=[*labels, "url"]
        )
        est = GaugeMetricFamily("pacer_worker_queue_estimate", "Estimated server-side queue per worker", labels=labels)
        waiting = GaugeMetricFamily("pacer_worker_queue_reqs", "Last scraped #queue-req per worker", labels=labels)
        usage = GaugeMetricFamily("pacer_worker_token_usage", "Last scraped KV token usage per worker", labels=labels)
        for load in self.board:
            at = [load.worker_id, pools.get(load.worker_id, "")]
            inflight.add_metric([*at, urls.get(load.worker_id, "")], load.in_flight)
            est.add_metric(at, load.est_queue())
            if load.sample is not None:
                waiting.add_metric(at, load.sample.queue)
                usage.add_metric(at, load.sample.token_usage)
        yield inflight
        yield est
        yield waiting
        yield usage
        yield from _gpu_families(self.gpus())


def _worker_families(workers: Sequence[WorkerInfo]) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    """Each worker's state by pool: an alert sees a worker down, or a pool with none serving."""
    labels = ["worker", "pool"]
    up = GaugeMetricFamily("pacer_worker_up", "1 while the worker serves (ready), else 0", labels=labels)
    state = GaugeMetricFamily(
        "pacer_worker_state", "1 for the state the worker is in (one series per state)", labels=[*labels, "state"]
    )
    restarts = CounterMetricFamily("pacer_worker_restarts", "Restarts of the worker (revivals included)", labels=labels)
    for w in workers:
        up.add_metric([w.id, w.pool], 1 if w.state is WorkerState.READY else 0)
        for s in WorkerState:
            state.add_metric([w.id, w.pool, s.value], 1 if w.state is s else 0)
        restarts.add_metric([w.id, w.pool], w.restarts)
    yield from (up, state, restarts)


def _admission_families(admission: QueueDepth) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    """Per class and key (the key's configured name: the label set is bounded by the configuration)."""
    labels = ["priority", "key"]
    waiting = GaugeMetricFamily("pacer_key_queue_depth", "Requests waiting in the proxy queue per key", labels=labels)
    dispatched = CounterMetricFamily(
        "pacer_key_dispatched_requests", "Requests handed to a worker per class and key", labels=labels
    )
    tokens = CounterMetricFamily(
        "pacer_key_dispatched_tokens",
        "Estimated tokens (prompt + max_tokens) handed to workers per class and key: the fair-share measure",
        labels=labels,
    )
    wait = CounterMetricFamily(
        "pacer_key_queue_wait_seconds", "Total time dispatched requests waited in the proxy queue", labels=labels
    )
    for p, key, st in admission.stats():
        lv = [p.value, key]
        waiting.add_metric(lv, st.waiting)
        dispatched.add_metric(lv, st.dispatched)
        tokens.add_metric(lv, st.dispatched_tokens)
        wait.add_metric(lv, st.wait_s)
    yield from (waiting, dispatched, tokens, wait)


def _gpu_families(report: GpuReport | None) -> Iterable[GaugeMetricFamily]:
    available = report is not None and report.available
    yield GaugeMetricFamily(
        "pacer_gpu_available", "1 when the last NVML sample read at least one GPU", value=1 if available else 0
    )
    labels = ["gpu", "name"]
    total = GaugeMetricFamily("pacer_gpu_memory_total_bytes", "GPU memory per device", labels=labels)
    used = GaugeMetricFamily(
        "pacer_gpu_memory_used_bytes", "GPU memory in use per device (all processes)", labels=labels
    )
    free = GaugeMetricFamily("pacer_gpu_memory_free_bytes", "GPU memory free per device", labels=labels)
    util = GaugeMetricFamily(
        "pacer_gpu_utilization_pct", "% of the last NVML sample period a kernel ran", labels=labels
    )
    for dev in report.devices if report is not None else ():
        key = [str(dev.index), dev.name]
        total.add_metric(key, dev.memory_total_bytes)
        used.add_metric(key, dev.memory_used_bytes)
        free.add_metric(key, dev.memory_free_bytes)
        if dev.utilization_gpu_pct is not None:
            util.add_metric(key, dev.utilization_gpu_pct)
    yield from (total, used, free, util)


@dataclass(frozen=True, slots=True)
class PoolMetrics:
    """What the request path counts for one pool's requests (:class:`~proxy.request.path.RequestMetrics`):
    its own series, and the door's refusals it shares with every pool."""

    admitted: Counter
    retried: Counter
    requeued: Counter
    completed: Counter
    disconnected: Counter
    continued: Counter
    budget_redone: Counter
    queue_time: Histogram
    added_latency: Histogram
    fail_timeout: Counter
    fail_pushed_out: Counter
    fail_no_worker: Counter
    fail_upstream: Counter
    fail_midstream: Counter
    reject_full: Counter
    reject_rate_limited: Counter
    reject_no_worker: Counter

    def count_requeue(self, why: Requeued) -> None:
        """An attempt ended without output and its request went back to the queue."""
        (self.requeued if why is Requeued.TAKEN_BACK else self.retried).inc()


class ProxyMetrics:
    """``admission``: the proxy's queue (every pool's); ``queues``: each pool's, by the pool's name
    (the request path's series carry it)."""

    def __init__(
        self,
        admission: QueueDepth,
        queues: Mapping[str, QueueDepth],
        board: LoadBoard,
        workers: Callable[[], Sequence[WorkerInfo]],
        gpus: GpuSource = _no_gpu_report,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        pool = ["pool"]
        self.admitted = Counter("pacer_requests_admitted", "Requests accepted into the proxy queue", pool, registry=r)
        self.rejected = Counter(
            "pacer_requests_rejected",
            "Requests refused at the door (auth, validation, full queue, rate limit, no worker)",
            ["reason"],
            registry=r,
        )
        self.retried = Counter(
            "pacer_requests_retried",
            "Attempts that failed before output, retried (or that found the worker unreachable)",
            pool,
            registry=r,
        )
        self.requeued = Counter(
            "pacer_requests_requeued", "Requests taken back from a worker before output", pool, registry=r
        )
        self.failed = Counter(
            "pacer_requests_failed", "Accepted requests that ended in an error", [*pool, "reason"], registry=r
        )
        self.completed = Counter("pacer_requests_completed", "Accepted requests answered by a worker", pool, registry=r)
        self.disconnected = Counter(
            "pacer_client_disconnects", "Clients that went away before their answer ended", pool, registry=r
        )
        self.continued = Counter(
            "pacer_output_budget_continuations",
            "Answers that reached their output budget and were continued (one per continuation)",
            pool,
            registry=r,
        )
        self.budget_redone = Counter(
            "pacer_output_budget_redone",
            "Answers that reached their output budget and could not be continued: sent again whole",
            pool,
            registry=r,
        )
        self.scrape_errors = Counter("pacer_scrape_errors", "Failed worker scrapes", ["worker"], registry=r)
        self.queue_time = Histogram(
            "pacer_queue_time_seconds",
            "Time a request waited in the proxy queue",
            pool,
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.added_latency = Histogram(
            "pacer_added_latency_seconds",
            "Time the proxy itself added before the upstream call and to the first chunk",
            pool,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_LiveState(admission, queues, board, workers, gpus))
        self.reject_full = self.rejected.labels("queue_full")
        self.reject_invalid = self.rejected.labels("invalid")
        self.reject_auth = self.rejected.labels("auth")
        self.reject_rate_limited = self.rejected.labels("rate_limited")
        self.reject_no_worker = self.rejected.labels("no_worker")  # every worker down (for good, or looping)
        self._pools = {name: self._bound(name) for name in queues}

    def _bound(self, pool: str) -> PoolMetrics:
        return PoolMetrics(
            admitted=self.admitted.labels(pool),
            retried=self.retried.labels(pool),
            requeued=self.requeued.labels(pool),
            completed=self.completed.labels(pool),
            disconnected=self.disconnected.labels(pool),
            continued=self.continued.labels(pool),
            budget_redone=self.budget_redone.labels(pool),
            queue_time=self.queue_time.labels(pool),
            added_latency=self.added_latency.labels(pool),
            fail_timeout=self.failed.labels(pool, "queue_timeout"),
            fail_pushed_out=self.failed.labels(pool, "pushed_out"),  # by another key's request from the full queue
            fail_no_worker=self.failed.labels(pool, "no_worker"),  # every worker down (for good, or looping)
            fail_upstream=self.failed.labels(pool, "upstream"),
            fail_midstream=self.failed.labels(pool, "mid_stream"),
            reject_full=self.reject_full,
            reject_rate_limited=self.reject_rate_limited,
            reject_no_worker=self.reject_no_worker,
        )

    def of(self, pool: str) -> PoolMetrics:
        """What the request path counts for ``pool``'s requests."""
        return self._pools[pool]

    def render(self) -> bytes:
        return generate_latest(self.registry)
