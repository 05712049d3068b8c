"""Engine-neutral vocabulary shared by the observers, the controller and the front door.

An engine module (``proxy.engines.sglang``, ``proxy.engines.vllm``) turns its engine's metrics page
and log lines into these values; nothing outside an engine module knows a metric name or a log
format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


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
    # prompt + output tokens of the finished requests, and how many they were (counters of the
    # engine's per-request histograms): their ratio over a window is the mean whole-request length
    finished_request_tokens_total: float | None = None
    finished_requests_total: float | None = None


def output_rate(before: Sample | None, now: Sample) -> float | None:
    """Output tokens per second: the engine's own throughput figure where it reports one (0 while
    nothing runs), else the rise of its output-token counter since the previous sample (an engine
    that exports only the counter); None when neither is known (also across a restart)."""
    if now.gen_throughput is not None:  # SGLang's gauge keeps its last decode batch's figure when idle
        return now.gen_throughput if now.running > 0 else 0.0
    if before is None or before.generation_tokens_total is None or now.generation_tokens_total is None:
        return None
    dt = now.time - before.time
    rise = now.generation_tokens_total - before.generation_tokens_total
    # a drop: the worker restarted and its counter began again at a moment the samples do not show
    return rise / dt if dt > 0 and rise >= 0 else None


class EventKind(StrEnum):
    """What a log line said, in engine-neutral words."""

    BATCH_STATS = "batch_stats"  # a periodic Decode/Prefill (SGLang) or stats (vLLM) line
    RETRACTION = "retraction"  # requests retracted / preempted because the KV pool is full
    STARTUP = "startup"  # the resolved capacity line at start-up
    READY = "ready"  # the server says it is ready to serve
    OOM = "oom"  # out of memory; ``fields["phase"]`` is "prefill", "decode" or "unknown"
    CRASH = "crash"  # an unhandled exception that kills the server
    # refuses to start: max model length > KV capacity. Fields, each where the refusal gives it:
    # ``max_context`` (the longest request it was started for, in tokens), ``estimated_max_context``
    # (the longest its KV cache holds, as the engine estimates it), ``needed_gib``, ``available_gib``
    KV_CAPACITY_ERROR = "kv_capacity_error"


@dataclass(frozen=True, slots=True, kw_only=True)
class LogEvent:
    """One meaningful log line of one worker."""

    kind: EventKind
    time: float  # monotonic seconds when the line was read
    fields: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    line: str = ""


class KnobName(StrEnum):
    """Engine arguments the controller may retune, in engine-neutral words."""

    CONSERVATIVENESS = "conservativeness"  # how much KV room admission keeps for running requests to grow
    PREFILL_CHUNK = "prefill_chunk"  # tokens of one prefill chunk (activation memory of a prefill step)
    MAX_RUNNING = "max_running"  # cap on requests in the running batch
    MEMORY_FRACTION = "memory_fraction"  # share of device memory for weights + KV pool
    MAX_CONTEXT = "max_context"  # longest request (prompt + output) the engine accepts; must fit the KV cache
    QUEUE_ORDER = "queue_order"  # the waiting queue's order; its choices: (by cached prefix, by arrival)
    GRAPH_MAX_BS = "graph_max_bs"  # the largest decode batch run as a captured CUDA graph (more: more memory)


class Choice(StrEnum):
    """Engine options a person must choose: they change the engine's numbers or its outputs. The
    controller journals them as suggestions with their reason and never sets them."""

    TORCH_COMPILE = "torch_compile"  # compile the model's forward (faster small batches; a slower start)
    FP8_WEIGHTS = "fp8_weights"  # quantize the weights to fp8 (half their memory; outputs change a little)
    FP8_KV_CACHE = "fp8_kv_cache"  # keep the KV cache in fp8 (twice the tokens; outputs change a little)
    CHUNKED_PREFILL = "chunked_prefill"  # split a long prefill over steps (a person switched it off)


@dataclass(frozen=True, slots=True, kw_only=True)
class Knob:
    """One retunable engine argument: its engine name, default and the values it may take.

    ``default`` is the engine's value when the argument is unset; ``None`` means the engine computes
    it at start-up, and ``resolved_field`` names the ``STARTUP`` event field that reports the value
    it chose. ``ladder`` lists the usual values in increasing order (a step moves to the next rung);
    a knob without a ladder moves by the step its caller gives, clamped to ``[minimum, maximum]``.
    ``disabled`` is a value that switches the feature off (SGLang's ``--chunked-prefill-size -1``).
    """

    name: KnobName
    arg: str  # the engine's argument name, with underscores
    default: float | None
    minimum: float
    maximum: float
    integer: bool = False
    ladder: tuple[float, ...] = ()
    resolved_field: str | None = None
    disabled: float | None = None
    # a knob that takes names, not numbers: the values the controller may choose between (its
    # ``default``, ``minimum`` and ``maximum`` then mean nothing)
    choices: tuple[str, ...] = ()

    def clamp(self, value: float) -> float | int:
        value = min(max(value, self.minimum), self.maximum)
        return int(value) if self.integer else round(value, 4)

    def rung_below(self, current: float, floor: float) -> float | int | None:
        """The highest ladder value below ``current`` and at least ``floor``; None when there is none.

        A disabled feature (``current == disabled``) steps to the top rung.
        """
        below = [v for v in self.ladder if (current == self.disabled or v < current) and v >= floor]
        return self.clamp(max(below)) if below else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Modelled:
    """The presets a simulated worker models, where its arguments name them (None: not named, or a
    real engine on the host's GPUs, whose GPU NVML says)."""

    gpu: str | None = None
    model: str | None = None
    # how fast the worker's clock runs: engine seconds per wall second (a simulator's time scale; a real
    # engine's is 1). The controller's constants are in engine seconds and are converted with it
    clock_rate: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Death:
    """Why a worker died, read from the last lines of its log."""

    cause: str  # "oom" | "crash" | "watchdog" | "kv_capacity" | "unknown"
    phase: str = "unknown"  # for "oom": "prefill" | "decode" | "unknown"
    detail: str = ""  # the exception or log line that says so
    started: bool = False  # whether the log shows the worker had become ready before it died


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeRoute:
    """One of an engine's own endpoints besides inference and ``/metrics`` that its clients call (model
    and server info, a deep health check, a cache flush, an abort by name): the proxy serves it as
    the engine does, from one ready worker of the model (``every_worker`` False: the answer is that
    worker's) or from each one that runs requests (True: one answer, a success only when every
    worker's was). ``operator``: it acts on every caller's work (a flush, an abort, which can end
    all): the admin key's, not a client's."""

    method: str  # "GET" or "POST"
    path: str
    every_worker: bool = False
    operator: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortByName:
    """How an engine aborts a running request by a name the client sent it under: ``field`` is the
    request body's field that names it, and posting ``{field: name}`` to ``path`` aborts it."""

    field: str  # SGLang: "rid"
    path: str  # SGLang: "/abort_request"
    # whether an aborted whole (not streamed) request is answered with what it wrote so far, so the
    # proxy can go on from there elsewhere (a request taken back from a worker that restarts keeps its
    # tokens); False: it is answered with an error, or not at all
    answers_with_output: bool

    def body(self, name: str) -> dict[str, str]:
        """The JSON body of the abort of the request sent under ``name``."""
        return {self.field: name}


def death_from_events(events: Sequence[LogEvent], lines: Sequence[str]) -> Death:
    """The death an engine's events over a dead worker's log tail (``lines``) tell of: the last OOM
    first, then the last crash, then a start-up refusal for KV capacity."""
    started = any(e.kind is EventKind.READY for e in events)
    ooms = [e for e in events if e.kind is EventKind.OOM]
    crashes = [e for e in events if e.kind is EventKind.CRASH]
    if ooms:
        last = ooms[-1]
        detail = str(crashes[-1].fields.get("exception", "")) if crashes else last.line
        return Death(
            cause="oom", phase=str(last.fields.get("phase", "unknown")), detail=detail or last.line, started=started
        )
    if crashes:
        last = crashes[-1]
        cause = "watchdog" if last.fields.get("cause") == "watchdog" else "crash"
        return Death(
            cause=cause,
            detail=str(last.fields.get("exception", last.line.splitlines()[0] if last.line else "")),
            started=started,
        )
    kv = [e for e in events if e.kind is EventKind.KV_CAPACITY_ERROR]
    if kv and not started:
        return Death(cause="kv_capacity", detail=kv[-1].line, started=started)
    return Death(cause="unknown", detail=lines[-1].strip() if lines else "", started=started)
