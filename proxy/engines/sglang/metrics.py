"""SGLang's Prometheus metrics page (``--enable-metrics``) -> an engine-neutral :class:`Sample`.

Names keep their colon (``sglang:num_queue_reqs``). Several scheduler ranks or DP ranks may each
emit a series; gauges of load are summed over them, usage and ratios take the maximum, counters are
summed. Names that differ between versions are listed oldest-last so the newest wins.
"""

from __future__ import annotations

from typing import Any

from proxy.engines import prometheus
from proxy.engines.base import Sample
from proxy.engines.prometheus import MAX, SUM, Fields, MetricsParseError

__all__ = ["FIELDS", "PREFIX", "READ", "MetricsParseError", "collect_series", "parse_loads", "parse_metrics"]

PREFIX = "sglang:"

FIELDS: Fields = {
    "queue": (("num_queue_reqs",), SUM),
    "running": (("num_running_reqs",), SUM),
    "token_usage": (("token_usage",), MAX),
    "gen_throughput": (("gen_throughput",), SUM),
    "cache_hit_rate": (("cache_hit_rate",), MAX),
    "new_token_ratio": (("new_token_ratio",), MAX),
    "max_total_tokens": (("max_total_num_tokens",), SUM),
    # 0.5.x counter; 0.4.10 named it total_retracted_reqs
    "retractions_total": (("num_retracted_requests_total", "total_retracted_reqs"), SUM),
    "prompt_tokens_total": (("prompt_tokens_total",), SUM),
    "generation_tokens_total": (("generation_tokens_total",), SUM),
    "requests_total": (("num_requests_total",), SUM),
}
READ = frozenset(n for names, _ in FIELDS.values() for n in names)  # the series parsed; the rest skipped unparsed


def collect_series(text: str) -> dict[str, list[float]]:
    """Every sample value of every ``sglang:`` series, keyed by its name without the prefix."""
    return prometheus.collect_series(text, PREFIX).values


def parse_metrics(text: str, now: float) -> Sample:
    """Parse one ``/metrics`` page scraped at monotonic time ``now``."""
    series = prometheus.collect_series(text, PREFIX, READ)
    found = prometheus.read_fields(series, FIELDS, prefix=PREFIX, hint="is --enable-metrics set?")
    max_total = found["max_total_tokens"]
    return Sample(
        time=now,
        queue=int(found["queue"] or 0),
        running=int(found["running"] or 0),
        token_usage=float(found["token_usage"] or 0.0),
        gen_throughput=found["gen_throughput"],
        cache_hit_rate=found["cache_hit_rate"],
        new_token_ratio=found["new_token_ratio"],
        max_total_tokens=int(max_total) if max_total is not None else None,
        retractions_total=found["retractions_total"],
        prompt_tokens_total=found["prompt_tokens_total"],
        generation_tokens_total=found["generation_tokens_total"],
        requests_total=found["requests_total"],
    )


def parse_loads(payload: dict[str, Any], now: float) -> Sample:
    """Parse ``GET /v1/loads`` JSON (0.5.23): sums over DP ranks."""
    loads = payload.get("loads")
    if not isinstance(loads, list) or not loads:
        raise MetricsParseError("/v1/loads answer has no 'loads' list")
    try:
        return Sample(
            time=now,
            queue=sum(int(x["num_waiting_reqs"]) for x in loads),
            running=sum(int(x["num_running_reqs"]) for x in loads),
            token_usage=max(float(x["token_usage"]) for x in loads),
            gen_throughput=sum(float(x.get("gen_throughput") or 0.0) for x in loads),
            cache_hit_rate=max(float(x.get("cache_hit_rate") or 0.0) for x in loads),
            max_total_tokens=sum(int(x.get("max_total_num_tokens") or 0) for x in loads) or None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MetricsParseError(f"/v1/loads entry malformed: {exc!r}") from exc
