"""vLLM's Prometheus metrics page (``GET /metrics`` on the API port) -> an engine-neutral :class:`Sample`.

Names keep their colon (``vllm:num_requests_waiting``). Every series carries ``model_name`` and
``engine`` labels (one per data-parallel engine): gauges of load are summed over engines, usage
takes the maximum, counters are summed (``vllm:request_success_total`` over its
``finished_reason`` label too). The KV gauge was renamed: ``vllm:kv_cache_usage_perc`` (a 0..1
fraction despite its name) is read first, then the old ``vllm:gpu_cache_usage_perc``. KV capacity
comes from the ``vllm:cache_config_info`` labels. Counters are exposed with ``_total`` whatever
the version declared; their ``_created`` twins are ignored.
"""

from __future__ import annotations

from proxy.engines import prometheus
from proxy.engines.base import Sample
from proxy.engines.prometheus import MAX, SUM, Fields, MetricsParseError, Series

__all__ = [
    "FIELDS",
    "PREFIX",
    "READ",
    "MetricsParseError",
    "Series",
    "collect_series",
    "kv_capacity_tokens",
    "parse_metrics",
]

PREFIX = "vllm:"

FIELDS: Fields = {
    "queue": (("num_requests_waiting",), SUM),
    "running": (("num_requests_running",), SUM),
    "token_usage": (("kv_cache_usage_perc", "gpu_cache_usage_perc"), MAX),
    "retractions_total": (("num_preemptions_total",), SUM),
    "prompt_tokens_total": (("prompt_tokens_total",), SUM),
    "generation_tokens_total": (("generation_tokens_total",), SUM),
    "requests_total": (("request_success_total",), SUM),
    # per finished request histograms (sum and count)
    "finished_prompt_tokens": (("request_prompt_tokens_sum",), SUM),
    "finished_generation_tokens": (("request_generation_tokens_sum",), SUM),
    "finished_requests_total": (("request_prompt_tokens_count",), SUM),
}
_PREFIX_HITS = ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total")
_PREFIX_QUERIES = ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total")


_CAPACITY = "cache_config_info"  # an info-style gauge: the KV capacity is in its labels
# every series parse_metrics reads; the page's histogram buckets are skipped unparsed
READ = frozenset({*(n for names, _ in FIELDS.values() for n in names), *_PREFIX_HITS, *_PREFIX_QUERIES, _CAPACITY})


def collect_series(text: str) -> Series:
    """Every ``vllm:`` series that :func:`parse_metrics` reads, prefix removed, with its labels."""
    return prometheus.collect_series(text, PREFIX, READ)


def kv_capacity_tokens(series: Series) -> int | None:
    """KV capacity in tokens summed over engines, from ``vllm:cache_config_info``'s labels:
    ``kv_cache_size_tokens`` (0.32), else ``num_gpu_blocks * block_size``."""
    total = 0
    for labels in series.labels.get(_CAPACITY, []):
        try:
            if labels.get("kv_cache_size_tokens", "None") != "None":
                total += int(labels["kv_cache_size_tokens"])
            else:
                total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None  # "None" before the engine has profiled memory
    return total or None


def parse_metrics(text: str, now: float) -> Sample:
    """Parse one ``/metrics`` page scraped at monotonic time ``now``."""
    series = collect_series(text)
    found = prometheus.read_fields(series, FIELDS, prefix=PREFIX, hint="is this a vLLM server?")
    hits = prometheus.first_of(series.values, _PREFIX_HITS, SUM)
    queries = prometheus.first_of(series.values, _PREFIX_QUERIES, SUM)
    return Sample(
        time=now,
        queue=int(found["queue"] or 0),
        running=int(found["running"] or 0),
        token_usage=float(found["token_usage"] or 0.0),
        # cumulative since start-up (vLLM exports counters only; the log line has the recent rate)
        cache_hit_rate=(hits / queries) if hits is not None and queries else None,
        max_total_tokens=kv_capacity_tokens(series),
        retractions_total=found["retractions_total"],
        prompt_tokens_total=found["prompt_tokens_total"],
        generation_tokens_total=found["generation_tokens_total"],
        requests_total=found["requests_total"],
        finished_request_tokens_total=_added(found["finished_prompt_tokens"], found["finished_generation_tokens"]),
        finished_requests_total=found["finished_requests_total"],
    )


def _added(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b
