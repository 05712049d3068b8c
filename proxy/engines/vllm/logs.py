"""vLLM's log lines -> engine-neutral :class:`LogEvent` values.

What is read (the V1 engine, and the V0 engine of 0.2-0.6 that many deployments still run):

- the periodic stats line -> ``BATCH_STATS`` (``running``, ``queue``, ``token_usage``,
  ``gen_throughput``, ``prompt_throughput``, ``engines``; V1's ``Preemptions`` part, present only
  when > 0, as ``retractions``; V0's ``Swapped`` as ``swapped``, its ``Max iteration time`` as
  ``max_iteration_s``). An idle engine logs it at DEBUG,
  so a missing line never means a stall;
- the V0 preemption warning -> ``RETRACTION`` (V1 logs none: read ``vllm:num_preemptions_total``);
- ``GPU KV cache size: N tokens`` (``CPU`` on the CPU build) -> ``STARTUP``; uvicorn's
  ``Application startup complete.`` -> ``READY``;
- the start-up refusals when the KV cache cannot hold one request of ``max_model_len`` tokens, in
  every version's wording (V1's carries the estimated maximum length) -> ``KV_CAPACITY_ERROR``;
- out of memory, in the wording of PyTorch, the CUDA runtime or driver, cuBLAS, NCCL, FlashInfer or vLLM ->
  ``OOM`` with a ``cause``. :class:`LogFollower` reads the traceback above it to place the OOM:
  under ``profile_run`` / ``_dummy_run`` in ``prefill``, under ``_dummy_sampler_run`` /
  ``capture_model`` in ``decode``;
- the engine dying (``Engine core initialization failed``, ``EngineDeadError``) -> ``CRASH``; the
  root cause, printed earlier by the engine-core process, comes first.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

from proxy.engines.base import Death, EventKind, LogEvent, death_from_events

_NUM = r"(\d[\d,]*(?:\.\d+)?)"

# The periodic stats line of the V1 engine (vllm/v1/metrics/loggers.py LoggingStatLogger.log): "Engine 000: "
# or "N Engines Aggregated: " since 0.9 (data parallelism); 0.7-0.8 printed the same line without that head.
STATS = re.compile(
    r"(?:(?:Engine (?P<engine>\d+)|(?P<engines>\d+) Engines Aggregated): )?"
    rf"Avg prompt throughput: {_NUM} tokens/s, Avg generation throughput: {_NUM} tokens/s, "
    rf"Running: (\d+) reqs, Waiting: (\d+) reqs, (?P<middle>.*?)"  # Deferred, KV fetch, Preemptions
    rf"(?:[\w+ ]+ )?KV cache usage: {_NUM}%(?:, Prefix cache hit rate: {_NUM}%)?"
)
# The V0 engine's (vllm/engine/metrics.py LoggingStatLogger.log, 0.4-0.6; vllm/engine/llm_engine.py
# _log_system_stats before 0.4): "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s,
# Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, GPU KV cache usage: %.1f%%, CPU KV cache usage: %.1f%%"
# with a closing "." since 0.4. The prefix cache hit rate is a line of its own there ("Prefix cache hit rate:
# GPU: x%, CPU: y%", 0.5.5+), not read. Pending is the waiting queue; Swapped the requests preempted to CPU.
# Builds that add parts of their own (``Max iteration time: 0.42 s``, anywhere after the throughputs) are
# read too: any "Name: value, " part may come between the ones read.
_PART = r"(?:[A-Z][\w ]*: [^,]*, )*?"
STATS_V0 = re.compile(
    rf"Avg prompt throughput: {_NUM} tokens/s, Avg generation throughput: {_NUM} tokens/s, {_PART}"
    rf"Running: (\d+) reqs, {_PART}Swapped: (\d+) reqs, {_PART}Pending: (\d+) reqs, {_PART}"
    rf"GPU KV cache usage: {_NUM}%(?:, CPU KV cache usage: {_NUM}%)?"
)
MAX_ITERATION = re.compile(rf"Max iteration time: {_NUM} ?(ms|s)?\b")  # the interval's longest engine step
PREEMPTIONS = re.compile(r"Preemptions: (\d+)")
PREEMPTED_V0 = re.compile(
    r"is preempted by (\S+) mode because there is not enough KV cache space.*?"
    r"(?:total_num_cumulative_preemption|total_cumulative_preemption_cnt)=(\d+)"
)
KV_SIZE = re.compile(
    rf"(?P<device>\w+)(?: \+ host)? KV cache size: {_NUM} tokens"
    rf"(?:, Maximum concurrency for {_NUM} tokens per request: {_NUM}x)?"
)
MAX_CONCURRENCY = re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x")  # older: own line
KV_V0 = re.compile(
    rf"max seq len \({_NUM}\) is larger than the maximum number of tokens that can be stored in KV cache \({_NUM}\)"
)
KV_V1 = re.compile(
    rf"max seq len \({_NUM}\), \({_NUM} GiB KV cache is needed, which is larger than the available "
    rf"KV cache memory \({_NUM} GiB\)(?:.*?estimated maximum model length is {_NUM})?"
)
NO_BLOCKS = "No available memory for the cache blocks"
# Out of memory, in the wording of whichever layer ran out:
#   PyTorch's caching allocator  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ..." (torch >= 2.5;
#                                "torch.cuda.OutOfMemoryError" 2.0-2.4, "RuntimeError: CUDA out of memory." older)
#   vLLM itself                  "CUDA out of memory occurred when warming up sampler ...", "Failed to load model -
#                                not enough GPU memory"
#   the CUDA runtime / driver    "CUDA error: out of memory" (+ "CUDA kernel errors might be asynchronously
#                                reported ..."), "cudaErrorMemoryAllocation"; "CUDA driver error: out of memory"
#                                (PyTorch's driver-API check: the allocator's expandable segments, the engine core)
#   cuBLAS                       "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
#   NCCL                         "Cuda failure 'out of memory'", "Cuda failure 2 'out of memory'"
#   FlashInfer                   "Failed to allocate memory for batch_prefill_tmp_v with size N and alignment 16 in
#                                AlignedAllocator" (include/flashinfer/allocator.h), "Out of workspace memory in
#                                AlignedAlloactor" (its older spelling)
OOM = re.compile(
    r"OutOfMemoryError|CUDA out of memory|out of memory occurred|not enough GPU memory"
    r"|CUDA [Ee]rror: out of memory|CUDA driver error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|Cuda failure (?:\d+ )?'out of memory'"
    r"|Failed to allocate memory for \w+ with size \d+ and alignment \d+ in AlignedAllocator"
    r"|Out of workspace memory in AlignedAllo(?:ca|ac)tor"
)
OOM_CAUSES: tuple[tuple[str, str], ...] = (  # substring of the OOM line -> cause, the first found wins
    ("Failed to load model", "weights"),
    ("AlignedAllo", "flashinfer_workspace"),
    ("flashinfer/", "flashinfer_workspace"),  # "CUDA Error: out of memory (2) .../flashinfer/handler.cuh"
    ("CUBLAS_STATUS_ALLOC_FAILED", "cublas"),
    ("Cuda failure", "nccl"),
)
OOM_PHASES: tuple[tuple[str, str], ...] = (  # substring of the OOM line -> phase
    ("warming up sampler", "decode"),  # a batch of max_num_seqs dummy requests
    ("batch_prefill_tmp", "prefill"),  # FlashInfer's prefill buffers
    ("batch_decode_tmp", "decode"),
)
SAMPLER_OOM = "warming up sampler"
# Frames that place an OOM: the start-up forward pass of max_num_batched_tokens tokens (V1
# gpu_model_runner.py profile_run / _dummy_run; V0 model_runner.py profile_run) is a prefill; the sampler
# warm-up (_dummy_sampler_run) and CUDA graph capture (capture_model: decode batches) are decode.
PHASE_FRAME = re.compile(r'File ".*", line \d+, in (?:(profile_run|_dummy_run)|(_dummy_sampler_run|capture_model))\b')
# PyTorch's caching allocator when a device allocation fails: "[W910 23:40:43.144601916 CUDACachingAllocator.cpp:3933]
# memory allocation failed with OOM on device 0 while trying to allocate 7516192768 bytes (free: ..., total: ...)".
# A warning: it frees its cache and tries again, and raises OutOfMemoryError (read above) only if that fails too.
# So no event of its own; it explains a death whose log says nothing else (classify_death).
ALLOCATOR_RETRY = "memory allocation failed with OOM"
CRASH = re.compile(r"Engine core initialization failed|EngineDeadError|EngineCore encountered an issue")
READY_MARKER = "Application startup complete."  # the server answers /health from this line on


def _n(text: str) -> float:
    return float(text.replace(",", ""))


def _event(kind: EventKind, now: float, line: str, **fields: float | int | str | bool) -> LogEvent:
    return LogEvent(kind=kind, time=now, fields=fields, line=line.rstrip("\n"))


def _stats_event(line: str, now: float) -> LogEvent | None:
    fields: dict[str, float | int | str | bool]
    if m := STATS.search(line):
        _engine, engines, prompt, gen, running, waiting, middle, usage, hit = m.groups()
        preempt = PREEMPTIONS.search(middle)
        fields = {
            "prompt_throughput": _n(prompt),
            "gen_throughput": _n(gen),
            "running": int(running),
            "queue": int(waiting),
            "token_usage": _n(usage) / 100.0,
            "retractions": int(preempt.group(1)) if preempt else 0,  # preemptions in this interval
            "engines": int(engines) if engines else 1,
        }
        if hit is not None:
            fields["cache_hit_rate"] = _n(hit) / 100.0
        return _event(EventKind.BATCH_STATS, now, line, **fields)
    if m := STATS_V0.search(line):
        prompt, gen, running, swapped, pending, usage, cpu_usage = m.groups()
        fields = {
            "prompt_throughput": _n(prompt),
            "gen_throughput": _n(gen),
            "running": int(running),
            "queue": int(pending),
            "swapped": int(swapped),
            "token_usage": _n(usage) / 100.0,
            "engines": 1,
        }  # no "retractions": V0 reports each preemption on a line of its own (RETRACTION)
        if cpu_usage is not None:
            fields["cpu_token_usage"] = _n(cpu_usage) / 100.0  # the swap space
        if (step := MAX_ITERATION.search(line)) is not None:
            fields["max_iteration_s"] = _n(step.group(1)) / (1000.0 if step.group(2) == "ms" else 1.0)
        return _event(EventKind.BATCH_STATS, now, line, **fields)
    return None


def _oom_event(line: str, now: float) -> LogEvent:
    phase = next((p for marker, p in OOM_PHASES if marker in line), "unknown")
    cause = next((c for marker, c in OOM_CAUSES if marker in line), "unknown")
    if phase == "decode" and SAMPLER_OOM in line:
        cause = "sampler_warmup"
    return _event(EventKind.OOM, now, line, phase=phase, cause=cause)


def parse_line(line: str, now: float) -> LogEvent | None:
    """One vLLM log line read at monotonic time ``now`` -> an event, or ``None`` if it says nothing we use.

    Each family is tried only when a substring it must contain is present: most lines of a busy
    server (HTTP access lines, request logs) contain none of them and cost a few substring scans.
    """
    if "throughput: " in line:
        return _stats_event(line, now)
    if "KV cache" in line or "max seq len" in line:
        if m := KV_V1.search(line):
            fields: dict[str, float | int | str | bool] = {
                "max_context": int(_n(m.group(1))), "needed_gib": _n(m.group(2)), "available_gib": _n(m.group(3)),
            }  # fmt: skip
            if m.group(4):
                fields["estimated_max_context"] = int(_n(m.group(4)))
            return _event(EventKind.KV_CAPACITY_ERROR, now, line, **fields)
        if m := KV_V0.search(line):
            return _event(
                EventKind.KV_CAPACITY_ERROR, now, line,
                max_context=int(_n(m.group(1))), estimated_max_context=int(_n(m.group(2))),
            )  # fmt: skip
        if m := PREEMPTED_V0.search(line):
            return _event(EventKind.RETRACTION, now, line, mode=m.group(1), retractions_total=int(m.group(2)))
        if m := KV_SIZE.search(line):
            fields = {"max_total_tokens": int(_n(m.group(2))), "device": m.group("device")}
            if m.group(3):
                fields |= {"max_model_len": int(_n(m.group(3))), "max_concurrency": _n(m.group(4))}
            return _event(EventKind.STARTUP, now, line, **fields)
    if NO_BLOCKS in line:
        return _event(EventKind.KV_CAPACITY_ERROR, now, line, no_cache_blocks=True)
    if ("emory" in line or "ALLOC_FAILED" in line or "Cuda failure" in line) and OOM.search(line):
        return _oom_event(line, now)
    if "Engine" in line and CRASH.search(line):
        return _event(EventKind.CRASH, now, line)
    if "Maximum concurrency" in line and (m := MAX_CONCURRENCY.search(line)):
        return _event(EventKind.STARTUP, now, line, max_model_len=int(_n(m.group(1))), max_concurrency=_n(m.group(2)))
    if READY_MARKER in line:
        return _event(EventKind.READY, now, line)
    return None


class LogFollower:
    """:func:`parse_line` with memory of the traceback lines just read, to place an OOM's phase.

    ``feed`` returns the events of one line; ``flush`` has nothing pending (every event is known
    when its line is read).
    """

    def __init__(self, context_lines: int = 60) -> None:
        self._recent: deque[str] = deque(maxlen=context_lines)
        self.allocator_retry: str | None = None  # the allocator's last failed first try since the server was ready

    def feed(self, line: str, now: float) -> list[LogEvent]:
        if ALLOCATOR_RETRY in line:
            self.allocator_retry = line.rstrip("\n")
        event = parse_line(line, now)
        if event is not None and event.kind is EventKind.READY:
            self.allocator_retry = None
        if event is not None and event.kind is EventKind.OOM and event.fields.get("phase") == "unknown":
            frame = next((m for m in map(PHASE_FRAME.search, reversed(self._recent)) if m), None)  # the innermost
            if frame is not None:
                phase, where = ("prefill", frame.group(1)) if frame.group(1) else ("decode", frame.group(2))
                event = LogEvent(kind=EventKind.OOM, time=event.time, line=event.line,
                                 fields={**event.fields, "phase": phase, "cause": where})  # fmt: skip
        if event is not None and event.kind in (EventKind.OOM, EventKind.READY):
            self._recent.clear()  # a traceback belongs to one error
        else:
            self._recent.append(line)
        return [event] if event is not None else []

    def flush(self, now: float) -> list[LogEvent]:
        del now
        return []


def classify_death(lines: Sequence[str], now: float = 0.0) -> Death:
    """Classify a dead worker from its log tail: the events :class:`LogFollower` reads in it. A start-up
    refusal for KV capacity is the cause even though the API server then reports the engine core's
    failure as a crash (the real cause is printed earlier: reference/vllm.md, start-up errors)."""
    follower = LogFollower()
    events = [event for line in lines for event in follower.feed(line, now)] + follower.flush(now)
    kinds = {event.kind for event in events}
    if EventKind.KV_CAPACITY_ERROR in kinds and EventKind.READY not in kinds and EventKind.OOM not in kinds:
        refusal = next(e for e in reversed(events) if e.kind is EventKind.KV_CAPACITY_ERROR)
        return Death(cause="kv_capacity", detail=refusal.line)
    death = death_from_events(events, lines)
    if death.cause in ("unknown", "crash") and follower.allocator_retry is not None:
        # nothing else says why (a crash line here is the API server's word that the engine core died): the
        # allocator's failed try is the last word on device memory before the end
        return Death(cause="oom", detail=follower.allocator_retry, started=death.started)
    return death
