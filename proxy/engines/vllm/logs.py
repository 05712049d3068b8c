"""vLLM's log lines -> engine-neutral :class:`LogEvent` values.

What is read (V1 engine; older spellings kept where the reference lists them):

- the periodic stats line, ``Engine 000: Avg prompt throughput: X tokens/s, Avg generation
  throughput: Y tokens/s, Running: R reqs, Waiting: W reqs, [Preemptions: P, ]GPU KV cache usage:
  U%, Prefix cache hit rate: H%`` (``CPU KV cache usage`` on the CPU build; ``N Engines
  Aggregated:`` under data parallelism; 0.32 may put ``Deferred`` and ``KV fetch`` parts before
  ``Preemptions``, which counts the interval's preemptions and appears only when > 0) -> ``BATCH_STATS``. An idle engine logs it at DEBUG, so a
  missing line never means a stall;
- the V0 preemption warning (``... is preempted by PreemptionMode.RECOMPUTE mode because there is
  not enough KV cache space ... total_num_cumulative_preemption=N``) -> ``RETRACTION``; V1 logs no
  per-preemption line (read ``vllm:num_preemptions_total`` or the stats line's ``Preemptions``);
- ``GPU KV cache size: 8,192 tokens, Maximum concurrency for 1,024 tokens per request: 8.00x``
  (``CPU ...`` on the CPU build; older versions print the two halves on separate lines) -> ``STARTUP``; uvicorn's ``Application startup complete.``
  -> ``READY``;
- the start-up refusals when the KV cache cannot hold one request of ``max_model_len`` tokens, in
  every version's wording (V0 ``max seq len (A) is larger than the maximum number of tokens that
  can be stored in KV cache (B)``; V1 ``... max seq len (A), (X GiB KV cache is needed, which is
  larger than the available KV cache memory (Y GiB). Based on the available memory, the estimated
  maximum model length is N``; and ``No available memory for the cache blocks``) ->
  ``KV_CAPACITY_ERROR``;
- out of memory (``torch.OutOfMemoryError``, ``CUDA out of memory``, ``Failed to load model - not
  enough GPU memory``) -> ``OOM``. The line alone rarely says the phase: the sampler warm-up's
  message (a batch of ``max_num_seqs`` dummy requests) is ``decode``; :class:`LogFollower`, which
  reads the traceback above the error, places an OOM raised under ``profile_run`` / ``_dummy_run``
  (the start-up forward pass of ``max_num_batched_tokens`` tokens) in ``prefill``;
- the engine dying (``Engine core initialization failed``, ``EngineDeadError``) -> ``CRASH``. The
  root cause is printed earlier by the engine-core process, so the KV or OOM event comes first.
"""

from __future__ import annotations

import re
from collections import deque

from proxy.engines.base import EventKind, LogEvent

_NUM = r"(\d[\d,]*(?:\.\d+)?)"

STATS = re.compile(
    r"(?:Engine (?P<engine>\d+)|(?P<engines>\d+) Engines Aggregated): "
    rf"Avg prompt throughput: {_NUM} tokens/s, Avg generation throughput: {_NUM} tokens/s, "
    rf"Running: (\d+) reqs, Waiting: (\d+) reqs, (?P<middle>.*?)"  # Deferred, KV fetch, Preemptions
    rf"(?:[\w+ ]+ )?KV cache usage: {_NUM}%(?:, Prefix cache hit rate: {_NUM}%)?"
)
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
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory occurred|not enough GPU memory")
SAMPLER_OOM = "warming up sampler"
WEIGHTS_OOM = "Failed to load model"
PREFILL_FRAME = re.compile(r'File ".*", line \d+, in (profile_run|_dummy_run)\b')
CRASH = re.compile(r"Engine core initialization failed|EngineDeadError|EngineCore encountered an issue")
READY_MARKER = "Application startup complete."  # the server answers /health from this line on


def _n(text: str) -> float:
    return float(text.replace(",", ""))


def _event(kind: EventKind, now: float, line: str, **fields: float | int | str | bool) -> LogEvent:
    return LogEvent(kind=kind, time=now, fields=fields, line=line.rstrip("\n"))


def parse_line(line: str, now: float) -> LogEvent | None:
    """One vLLM log line read at monotonic time ``now`` -> an event, or ``None`` if it says nothing we use."""
    if m := STATS.search(line):
        _engine, engines, prompt, gen, running, waiting, middle, usage, hit = m.groups()
        preempt = PREEMPTIONS.search(middle)
        fields: dict[str, float | int | str | bool] = {
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
    if m := KV_V1.search(line):
        fields = {"max_model_len": int(_n(m.group(1))), "needed_gib": _n(m.group(2)), "available_gib": _n(m.group(3))}
        if m.group(4):
            fields["estimated_max_model_len"] = int(_n(m.group(4)))
        return _event(EventKind.KV_CAPACITY_ERROR, now, line, **fields)
    if m := KV_V0.search(line):
        return _event(
            EventKind.KV_CAPACITY_ERROR, now, line,
            max_model_len=int(_n(m.group(1))), estimated_max_model_len=int(_n(m.group(2))),
        )  # fmt: skip
    if NO_BLOCKS in line:
        return _event(EventKind.KV_CAPACITY_ERROR, now, line, no_cache_blocks=True)
    if m := PREEMPTED_V0.search(line):
        return _event(EventKind.RETRACTION, now, line, mode=m.group(1), retractions_total=int(m.group(2)))
    if OOM.search(line):
        if SAMPLER_OOM in line:
            return _event(EventKind.OOM, now, line, phase="decode", cause="sampler_warmup")
        return _event(EventKind.OOM, now, line, phase="unknown", cause="weights" if WEIGHTS_OOM in line else "unknown")
    if CRASH.search(line):
        return _event(EventKind.CRASH, now, line)
    if m := KV_SIZE.search(line):
        fields = {"max_total_tokens": int(_n(m.group(2))), "device": m.group("device")}
        if m.group(3):
            fields |= {"max_model_len": int(_n(m.group(3))), "max_concurrency": _n(m.group(4))}
        return _event(EventKind.STARTUP, now, line, **fields)
    if m := MAX_CONCURRENCY.search(line):
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

    def feed(self, line: str, now: float) -> list[LogEvent]:
        event = parse_line(line, now)
        if event is not None and event.kind is EventKind.OOM and event.fields.get("phase") == "unknown":
            frame = next((m for m in map(PREFILL_FRAME.search, reversed(self._recent)) if m), None)
            if frame is not None:
                event = LogEvent(kind=EventKind.OOM, time=event.time, line=event.line,
                                 fields={**event.fields, "phase": "prefill", "cause": frame.group(1)})  # fmt: skip
        if event is not None and event.kind in (EventKind.OOM, EventKind.READY):
            self._recent.clear()  # a traceback belongs to one error
        else:
            self._recent.append(line)
        return [event] if event is not None else []

    def flush(self, now: float) -> list[LogEvent]:
        del now
        return []
