"""Engine-neutral vocabulary shared by the observers, the controller and the front door.

An engine module (``proxy.engines.sglang``, ``proxy.engines.vllm``) turns its engine's metrics page
and log lines into these values; nothing outside an engine module knows a metric name or a log
format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One scrape of one worker's load signals.

    Gauges are instantaneous; ``*_total`` fields are the engine's monotonically increasing counters
    (a restart resets them: consumers difference them and treat a drop as a reset).
    ``None`` means the engine did not report the field.
    """

    time: float  # monotonic seconds when the scrape finished
    queue: int  # requests waiting in the server-side queue (#queue-req)
    running: int  # requests in the running batch (#running-req)
    token_usage: float  # KV pool usage, 0..1
    gen_throughput: float | None = None  # output tokens/s as the engine reports it
    cache_hit_rate: float | None = None  # 0..1
    new_token_ratio: float | None = None  # SGLang's live conservativeness ratio
    max_total_tokens: int | None = None  # KV pool capacity in tokens
    retractions_total: float | None = None  # retracted (SGLang) / preempted (vLLM) requests, counter
    prompt_tokens_total: float | None = None  # counter
    generation_tokens_total: float | None = None  # counter
    requests_total: float | None = None  # finished requests, counter


class EventKind(StrEnum):
    """What a log line said, in engine-neutral words."""

    BATCH_STATS = "batch_stats"  # a periodic Decode/Prefill (SGLang) or stats (vLLM) line
    RETRACTION = "retraction"  # requests retracted / preempted because the KV pool is full
    STARTUP = "startup"  # the resolved capacity line at start-up
    READY = "ready"  # the server says it is ready to serve
    OOM = "oom"  # out of memory; ``fields["phase"]`` is "prefill", "decode" or "unknown"
    CRASH = "crash"  # an unhandled exception that kills the server
    KV_CAPACITY_ERROR = "kv_capacity_error"  # refuses to start: max model length > KV capacity


@dataclass(frozen=True, slots=True, kw_only=True)
class LogEvent:
    """One meaningful log line of one worker."""

    kind: EventKind
    time: float  # monotonic seconds when the line was read
    fields: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    line: str = ""
