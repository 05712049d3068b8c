"""``/metrics`` (with ``--enable-metrics``): SGLang 0.5.23's names, types and labels, in a registry
of the server's own.

Scheduler gauges carry ``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`` and are refreshed
when SGLang refreshes them: at each prefill and decode log (and, here, when the scheduler goes
idle). ``num_retracted_reqs`` / ``num_paused_reqs`` also carry ``pid`` as SGLang's multiprocess
collector adds it. Tokenizer metrics carry ``model_name, engine_type`` (+ ``is_streaming``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from proxy.sim.config import SimConfig

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS = (
    0.0,
    0.1,
    0.2,
    0.5,
    1,
    2,
    3,
    4,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    70,
    80,
    90,
    100,
    200,
    300,
    400,
    500,
    600,
    700,
    800,
    900,
    1000,
    1200,
    1400,
    1600,
    1800,
    2000,
    2500,
    3000,
)


class WeightedHistogram(Collector):
    """A histogram that takes ``observe(value, count)``: a decode step gives every running request
    the same inter-token interval, so one call covers the whole batch."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], labels: dict[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += count
                break
        else:
            self.counts[-1] += count
        self.total += value * count

    def collect(self) -> Iterable[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cum, buckets = 0, []
        for b, c in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cum += c
            buckets.append((b if b == "+Inf" else str(float(b)), cum))
        fam.add_metric(list(self.labels.values()), buckets, self.total)
        yield fam


class SimMetrics:
    def __init__(self, cfg: SimConfig) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # SGLang's multiprocess collector exposes no *_created series
        self.registry = CollectorRegistry(auto_describe=True)
        sched = {
            "model_name": cfg.served_model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        tok = {"model_name": cfg.served_model_name, "engine_type": "unified"}
        self._sched_labels, self._tok_labels = sched, tok
        self._declare_scheduler_metrics(list(sched))
        self._declare_token_metrics()
        self._set_startup(cfg)

    def _declare_scheduler_metrics(self, names: list[str]) -> None:
        """The scheduler's series (labelled by rank), as SGLang's scheduler collector names them."""
        reg, sched = self.registry, self._sched_labels

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(f"sglang:{name}", doc, [*names, *extra], registry=reg)

        g = {n: gauge(n, d) for n, d in (
            ("num_running_reqs", "The number of running requests."),
            ("num_queue_reqs", "The number of requests in the waiting queue."),
            ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
            ("gen_throughput", "The generation throughput (token/s)."),
            ("cache_hit_rate", "The prefix cache hit rate."),
            ("token_usage", "The token usage."),
            ("full_token_usage", "The token usage of the full attention pool."),
            ("num_used_tokens", "The number of used tokens."),
            ("kv_available_tokens", "KV tokens free for allocation."),
            ("kv_evictable_tokens", "KV tokens held by the prefix cache and evictable."),
            ("kv_used_tokens", "KV tokens in use."),
            ("new_token_ratio", "The new token ratio."),
            ("utilization", "The utilization."),
            ("decode_sum_seq_lens", "The sum of all sequence lengths in decode."),
            ("is_cuda_graph", "Whether the last batch ran as a CUDA graph."),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
            ("page_size", "The page size."),
            ("num_pages", "The number of KV pages."),
            ("context_len", "The context length."),
            ("startup_available_gpu_memory_gb", "Available GPU memory at start-up (GB)."),
            ("weight_memory_usage_gb", "Memory used by the weights (GB)."),
            ("kv_cache_memory_usage_gb", "Memory used by the KV cache (GB)."),
        )}  # fmt: skip
        self.g = g
        self.retracted_gauge = gauge("num_retracted_reqs", "The number of retracted requests.", ["pid"])
        self.paused_gauge = gauge("num_paused_reqs", "The number of paused requests.", ["pid"])
        self.graph_mem = gauge("graph_memory_usage_gb", "Memory used by CUDA graphs (GB).", ["phase"])
        self.retracted_total = Counter(
            "sglang:num_retracted_requests_total", "Total retracted requests.", names, registry=reg
        ).labels(**sched)
        self.retracted_in = Counter(
            "sglang:num_retracted_input_tokens_total", "Input tokens of retracted requests.", names, registry=reg
        ).labels(**sched)
        self.retracted_out = Counter(
            "sglang:num_retracted_output_tokens_total", "Output tokens of retracted requests.", names, registry=reg
        ).labels(**sched)
        self.graph_passes = Counter(
            "sglang:cuda_graph_passes_total", "Forward passes by mode.", [*names, "mode"], registry=reg
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds", "Time spent in the waiting queue.", names, buckets=QUEUE_BUCKETS, registry=reg
        ).labels(**sched)

    def _declare_token_metrics(self) -> None:
        """The tokenizer manager's series (requests, tokens, latencies)."""
        reg, tok = self.registry, self._tok_labels
        tnames, st = list(tok), [*tok, "is_streaming"]
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", st, registry=reg
        )
        self.gen_tokens = Counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", st, registry=reg
        )
        self.requests = Counter("sglang:num_requests_total", "Number of requests processed.", st, registry=reg)
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total", "Number of cached prompt tokens.", [*tnames, "cache_source"], registry=reg
        ).labels(**tok, cache_source="device")
        self.aborted = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", tnames, registry=reg
        ).labels(**tok)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            st,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            st,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.itl = WeightedHistogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS, tok
        )
        reg.register(self.itl)

    def _set_startup(self, cfg: SimConfig) -> None:
        """What the start-up fixes: the pool, the memory split, and an idle load."""
        sched, g = self._sched_labels, self.g
        pid = str(os.getpid())
        self.retracted_gauge.labels(**sched, pid=pid).set(0)
        self.paused_gauge.labels(**sched, pid=pid).set(0)
        self._retracted = self.retracted_gauge.labels(**sched, pid=pid)
        mem, per_gpu = cfg.memory, 1024 * cfg.tp_size  # rank 0's collector: its own GPU's share
        for name, value in (
            ("max_total_num_tokens", cfg.max_total_num_tokens),
            ("page_size", 1),
            ("num_pages", cfg.max_total_num_tokens),
            ("context_len", cfg.context_len),
            ("startup_available_gpu_memory_gb", round(mem.available_mib / per_gpu, 2)),
            ("weight_memory_usage_gb", round(mem.weights_mib / per_gpu, 2)),
            ("kv_cache_memory_usage_gb", round(mem.kv_pool_mib / per_gpu, 2)),
        ):
            g[name].labels(**sched).set(value)
        self.graph_mem.labels(**sched, phase="decode").set(round(mem.graph_mib / per_gpu, 2))
        self.set_load(
            running=0,
            queue=0,
            usage=0.0,
            used=0,
            available=cfg.max_total_num_tokens,
            evictable=0,
            ratio=0.0,
            gen_throughput=0.0,
            cache_hit_rate=0.0,
            seq_lens=0,
            cuda_graph=False,
            retracted_now=0,
        )

    def set_load(
        self,
        *,
        running: int,
        queue: int,
        usage: float,
        used: int,
        available: int,
        evictable: int,
        ratio: float,
        gen_throughput: float,
        cache_hit_rate: float,
        seq_lens: int,
        cuda_graph: bool,
        retracted_now: int,
    ) -> None:
        s, g = self._sched_labels, self.g
        g["num_running_reqs"].labels(**s).set(running)
        g["num_queue_reqs"].labels(**s).set(queue)
        g["num_grammar_queue_reqs"].labels(**s).set(0)
        g["token_usage"].labels(**s).set(round(usage, 2))
        g["full_token_usage"].labels(**s).set(round(usage, 2))
        g["num_used_tokens"].labels(**s).set(used)
        g["kv_used_tokens"].labels(**s).set(used)
        g["kv_available_tokens"].labels(**s).set(available)
        g["kv_evictable_tokens"].labels(**s).set(evictable)
        g["new_token_ratio"].labels(**s).set(ratio)
        g["gen_throughput"].labels(**s).set(gen_throughput)
        g["cache_hit_rate"].labels(**s).set(cache_hit_rate)
        g["utilization"].labels(**s).set(1.0 if running else 0.0)
        g["decode_sum_seq_lens"].labels(**s).set(seq_lens)
        g["is_cuda_graph"].labels(**s).set(1.0 if cuda_graph else 0.0)
        self._retracted.set(retracted_now)

    def gen_throughput_stale(self) -> None:
        """SGLang zeroes gen_throughput when no decode log came for 30 s."""
        self.g["gen_throughput"].labels(**self._sched_labels).set(0.0)

    def on_retract(self, count: int, input_tokens: int, output_tokens: int) -> None:
        self.retracted_total.inc(count)
        self.retracted_in.inc(input_tokens)
        self.retracted_out.inc(output_tokens)

    def on_first_token(self, ttft: float, streaming: bool) -> None:
        self.ttft.labels(**self._tok_labels, is_streaming=_b(streaming)).observe(ttft)

    def on_finish(
        self, *, prompt_tokens: int, output_tokens: int, cached_tokens: int, e2e: float, streaming: bool, aborted: bool
    ) -> None:
        labels = {**self._tok_labels, "is_streaming": _b(streaming)}
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.gen_tokens.labels(**labels).inc(output_tokens)
        self.requests.labels(**labels).inc()
        self.cached_tokens.inc(cached_tokens)
        self.e2e.labels(**labels).observe(e2e)
        if aborted:
            self.aborted.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _b(flag: bool) -> str:
    return "true" if flag else "false"
