"""SGLang's log lines -> engine-neutral :class:`LogEvent` values.

Two layers:

* :func:`parse_line` is pure and looks at one line: the periodic ``Decode batch`` / ``Prefill batch``
  statistics, retractions (0.5.23 WARNING form, the 0.4.10/0.5.5 INFO form and the older
  ``Decode out of memory happened`` wording), the start-up capacity line, readiness, the KV
  allocator's out-of-memory errors and the KV-pool-vs-context-length warning.
* :class:`LogFollower` keeps the little state a crash needs: ``Scheduler hit an exception:`` is
  followed by a traceback on lines of their own, and only the traceback tells a CUDA OOM in
  prefill from one in decode. The follower collects the block until the next prefixed log line
  (or :meth:`LogFollower.flush`) and then emits one ``CRASH`` event, plus an ``OOM`` event when the
  death was an out-of-memory that no allocator line had reported yet.

:func:`classify_death` runs a fresh follower over the last lines of a dead worker's log.

Every line starts with ``[%(asctime)s{ms}{prefix}] `` where the prefix names ranks
(`` DP1 PP0 TP3 EP2``); the ranks go into the event's fields (``tp_rank``, ``dp_rank``...).
Field names are engine-neutral (``queue``, ``running``, ``token_usage``, ``gen_throughput``,
``retracted``, ``max_total_tokens``, ``available_gpu_mem_gb``, ``phase``...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from proxy.engines.base import EventKind, LogEvent

__all__ = ["Death", "LogFollower", "classify_death", "parse_line"]

Fields = dict[str, float | int | str | bool]

# "[2026-09-13 16:06:05 DP0 TP1] message" / "[2026-09-13 16:06:05,123] message"
_PREFIX = re.compile(r"^\s*\[(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?)(?P<ranks>(?: [A-Z_]+\d+)*)\]\s?")
_RANK = re.compile(r"([A-Z_]+?)(\d+)$")
_RANK_KEYS = {"TP": "tp_rank", "DP": "dp_rank", "PP": "pp_rank", "EP": "ep_rank", "ATTN_CP": "attn_cp_rank", "MOE_DP": "moe_dp_rank"}

_BATCH = re.compile(r"\b(?P<kind>Decode|Prefill) batch(?: \[(?P<iter>\d+)\])?[.,]\s*(?P<rest>.*)$")
_RETRACT = re.compile(
    r"(?P<head>KV cache pool is full\. Retract requests\.|Testing retraction\.|[Dd]ecode out of memory happened[.,])"
    r"\s*(?P<rest>.*)$"
)
_RATIO = re.compile(r"#new_token_ratio:\s*(?P<before>[-\d.eE+]+)\s*->\s*(?P<after>[-\d.eE+]+)")
_STARTUP = re.compile(r"\bmax_total_num_tokens=\d+")
_KV_VS_CONTEXT = re.compile(r"KV pool holds (?P<kv>\d+) tokens, fewer than --context-length (?P<ctx>\d+)")
_ALLOC_OOM = re.compile(r"\b(?P<phase>Prefill|Decode) out of memory\. Try to lower your batch size")
_SLOTS_OOM = re.compile(r"alloc_req_slots runs out of memory")
_EXCEPTION = re.compile(r"\b(?P<who>Scheduler|DetokenizerManager|TokenizerManager|DataParallelController) hit an exception:?\s*(?P<rest>.*)$")
_WATCHDOG = re.compile(r"watchdog timeout", re.IGNORECASE)
READY_MARKER = "fired up and ready to roll"  # the last start-up line: /health answers 200 from here on

# Statistics keys as SGLang prints them -> engine-neutral field names.
_BATCH_KEYS: dict[str, str] = {
    "#running-req": "running",
    "#queue-req": "queue",
    "#token": "used_tokens",
    "#full token": "used_tokens",
    "token usage": "token_usage",
    "full token usage": "full_token_usage",
    "#swa token": "swa_used_tokens",
    "swa token usage": "swa_token_usage",
    "mamba num": "mamba_used",
    "mamba usage": "mamba_usage",
    "gen throughput (token/s)": "gen_throughput",
    "input throughput (token/s)": "input_throughput",
    "#new-seq": "new_seqs",
    "#new-token": "new_tokens",
    "#cached-token": "cached_tokens",
    "#pending-token": "pending_tokens",
    "#replay-token": "replay_tokens",
    "accept len": "spec_accept_len",
    "accept rate": "spec_accept_rate",
    "pre-allocated usage": "prealloc_usage",
    "#prealloc-req": "prealloc_queue",
    "#transfer-req": "transfer_queue",
    "#host-receive-req": "host_receive_queue",
    "#retracted-req": "retracted_queue",
    "#bootstrap-req": "bootstrap_queue",
    "#inflight-req": "inflight_queue",
    "#optimistic-req": "optimistic_queue",
}
_GRAPH_KEYS = ("cuda graph", "cpu graph", "npu graph", "musa graph")
_USAGE_KEYS = ("token_usage", "full_token_usage", "swa_token_usage", "mamba_usage")

_STARTUP_KEYS: dict[str, str] = {
    "max_total_num_tokens": "max_total_tokens",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_prefill_tokens": "max_prefill_tokens",
    "max_running_requests": "max_running_requests",
    "context_len": "context_len",
    "available_gpu_mem": "available_gpu_mem_gb",
    "available_cpu_mem": "available_cpu_mem_gb",
}

_RETRACT_KEYS: dict[str, str] = {
    "#retracted_reqs": "retracted",
    "#new_tokens_gained": "new_tokens_gained",
    "#mamba_num_gained": "mamba_num_gained",
}


def _number(text: str) -> float | int | bool | str:
    text = text.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _split_prefix(line: str) -> tuple[Fields, str, bool]:
    """(rank fields, message, whether the line carried SGLang's logger prefix)."""
    match = _PREFIX.match(line)
    if match is None:
        return {}, line.strip(), False
    ranks: Fields = {}
    for token in match.group("ranks").split():
        rank = _RANK.match(token)
        if rank and rank.group(1) in _RANK_KEYS:
            ranks[_RANK_KEYS[rank.group(1)]] = int(rank.group(2))
    return ranks, line[match.end():].strip(), True


def _pairs(text: str, sep: str) -> Iterable[tuple[str, str]]:
    """``key<sep> value`` pieces of a comma-separated list; pieces without ``sep`` are skipped."""
    for piece in text.split(","):
        key, found, value = piece.partition(sep)
        if found and key.strip():
            yield key.strip(), value.strip()


def _batch_event(match: re.Match[str], ranks: Fields, now: float, line: str) -> LogEvent:
    fields: Fields = {**ranks, "phase": match.group("kind").lower()}
    if match.group("iter"):
        fields["iteration"] = int(match.group("iter"))
    for key, value in _pairs(match.group("rest"), ":"):
        if key in _BATCH_KEYS:
            fields[_BATCH_KEYS[key]] = _number(value)
        elif key in _GRAPH_KEYS:
            fields["graph"] = value == "True"
    usages = [float(fields[k]) for k in _USAGE_KEYS if isinstance(fields.get(k), (int, float))]
    if usages:  # like sglang:token_usage, the fullest of the pools
        fields["token_usage"] = max(usages)
    return LogEvent(kind=EventKind.BATCH_STATS, time=now, fields=fields, line=line)


def _retraction_event(match: re.Match[str], ranks: Fields, now: float, line: str) -> LogEvent:
    fields: Fields = dict(ranks)
    rest = match.group("rest")
    ratio = _RATIO.search(rest)
    if ratio:
        fields["new_token_ratio_before"] = float(ratio.group("before"))
        fields["new_token_ratio_after"] = float(ratio.group("after"))
        rest = rest[: ratio.start()]
    for key, value in _pairs(rest, ":"):
        if key in _RETRACT_KEYS:
            fields[_RETRACT_KEYS[key]] = _number(value)
    fields.setdefault("retracted", 1)
    if match.group("head").startswith("Testing"):
        fields["forced"] = True  # SGLang's retraction test mode, not memory pressure
    return LogEvent(kind=EventKind.RETRACTION, time=now, fields=fields, line=line)


def _startup_event(message: str, ranks: Fields, now: float, line: str) -> LogEvent:
    fields: Fields = dict(ranks)
    for key, value in _pairs(message, "="):
        if key in _STARTUP_KEYS:
            fields[_STARTUP_KEYS[key]] = _number(value.removesuffix("GB").strip())
    if "available_cpu_mem_gb" in fields:
        fields["device"] = "cpu"
    return LogEvent(kind=EventKind.STARTUP, time=now, fields=fields, line=line)


def parse_line(line: str, now: float) -> LogEvent | None:
    """The event one log line reports, or ``None`` for a line the controller does not use.

    ``now`` is the monotonic time the line was read (the line's own wall-clock stamp is ignored).
    A ``Scheduler hit an exception`` line yields a ``CRASH`` event with ``phase`` "unknown": only
    :class:`LogFollower`, which reads the traceback that follows, can tell more.
    """
    line = line.rstrip("\r\n")
    ranks, message, _ = _split_prefix(line)
    if not message:
        return None
    if (batch := _BATCH.search(message)) is not None:
        return _batch_event(batch, ranks, now, line)
    if (retract := _RETRACT.search(message)) is not None:
        return _retraction_event(retract, ranks, now, line)
    if _STARTUP.search(message):
        return _startup_event(message, ranks, now, line)
    if READY_MARKER in message:
        return LogEvent(kind=EventKind.READY, time=now, fields=dict(ranks), line=line)
    if (alloc := _ALLOC_OOM.search(message)) is not None:
        fields: Fields = {**ranks, "phase": alloc.group("phase").lower(), "cause": "kv_pool"}
        return LogEvent(kind=EventKind.OOM, time=now, fields=fields, line=line)
    if _SLOTS_OOM.search(message):
        # The request-slot pool is sized by --max-running-requests: the decode remedy applies.
        fields = {**ranks, "phase": "decode", "cause": "request_slots"}
        return LogEvent(kind=EventKind.OOM, time=now, fields=fields, line=line)
    if (kv := _KV_VS_CONTEXT.search(message)) is not None:
        fields = {**ranks, "kv_tokens": int(kv.group("kv")), "context_len": int(kv.group("ctx")), "fatal": False}
        return LogEvent(kind=EventKind.KV_CAPACITY_ERROR, time=now, fields=fields, line=line)
    if (exc := _EXCEPTION.search(message)) is not None:
        fields = {**ranks, "process": exc.group("who"), "phase": "unknown", "oom": False}
        return LogEvent(kind=EventKind.CRASH, time=now, fields=fields, line=line)
    if _WATCHDOG.search(message):
        fields = {**ranks, "cause": "watchdog", "phase": "unknown", "oom": False}
        return LogEvent(kind=EventKind.CRASH, time=now, fields=fields, line=line)
    return None


# -- crashes: a traceback spans many lines ------------------------------------------------------

_CUDA_OOM = re.compile(r"(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory)")
_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)|RuntimeError|AssertionError)\b.*")
# Markers of the phase a traceback died in, from SGLang's scheduler / model-runner function names and
# the allocator's own messages. The innermost (last) marker wins.
_PHASE_MARKERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Prefill out of memory|forward_extend|prepare_for_extend|alloc_for_extend|get_new_batch_prefill|process_batch_result_prefill|chunked_prefill"), "prefill"),
    (re.compile(r"Decode out of memory|alloc_req_slots|forward_decode|prepare_for_decode|alloc_for_decode|update_running_batch|process_batch_result_decode"), "decode"),
)  # fmt: skip
_MAX_BLOCK = 400  # lines kept of one traceback


def _traceback_fields(lines: Sequence[str]) -> Fields:
    """What a traceback says: the exception line, whether it was an OOM, and in which phase."""
    fields: Fields = {"oom": False, "phase": "unknown"}
    exception = ""
    for text in lines:
        stripped = text.strip()
        if _EXC_LINE.match(stripped):
            exception = stripped
        if _CUDA_OOM.search(stripped) or _ALLOC_OOM.search(stripped) or _SLOTS_OOM.search(stripped):
            fields["oom"] = True
        for pattern, phase in _PHASE_MARKERS:
            if pattern.search(stripped):
                fields["phase"] = phase
    if exception:
        fields["exception"] = exception[:300]
    if _SLOTS_OOM.search(" ".join(lines)):
        fields["cause"] = "request_slots"
    elif any(_ALLOC_OOM.search(t) for t in lines):
        fields["cause"] = "kv_pool"
    elif fields["oom"]:
        fields["cause"] = "device_memory"
    return fields


@dataclass(slots=True)
class LogFollower:
    """Turns a worker's log, line by line, into events; crash tracebacks are read as one block.

    ``feed`` returns the events a line completes (often none, sometimes two: the end of a
    traceback block and the line that ended it). ``flush`` ends a pending block (call it when the
    process exits). The phase of the last ``Prefill batch`` / ``Decode batch`` line is the fallback
    for a crash whose traceback names no phase (``phase_source`` says which was used).
    """

    _block: list[str] | None = None
    _block_head: LogEvent | None = None
    _last_batch_phase: str | None = None
    _oom_since_crash: str | None = None  # phase of an OOM already reported for this incident

    def feed(self, line: str, now: float) -> list[LogEvent]:
        line = line.rstrip("\r\n")
        events: list[LogEvent] = []
        _, _, prefixed = _split_prefix(line)
        if self._block is not None:
            if not prefixed and len(self._block) < _MAX_BLOCK:
                self._block.append(line)
                return events
            events.extend(self.flush(now))
        event = parse_line(line, now)
        if event is None:
            return events
        if event.kind is EventKind.CRASH and event.fields.get("process") is not None:
            head_message = _split_prefix(line)[1]
            self._block = [head_message]
            self._block_head = event
            return events
        if event.kind is EventKind.BATCH_STATS:
            self._last_batch_phase = str(event.fields.get("phase"))
        elif event.kind is EventKind.OOM:
            self._oom_since_crash = str(event.fields.get("phase"))
        elif event.kind is EventKind.READY:
            self._oom_since_crash = None
        events.append(event)
        return events

    def flush(self, now: float) -> list[LogEvent]:
        """End a pending traceback block: its ``CRASH`` event (and ``OOM`` event) come out now."""
        if self._block is None or self._block_head is None:
            return []
        head, block = self._block_head, self._block
        self._block, self._block_head = None, None
        fields: Fields = {**head.fields, **_traceback_fields(block)}
        if fields["phase"] != "unknown":
            fields["phase_source"] = "traceback"
        elif self._oom_since_crash is not None:
            fields["phase"], fields["phase_source"] = self._oom_since_crash, "allocator"
        elif fields["oom"] and self._last_batch_phase is not None:
            fields["phase"], fields["phase_source"] = self._last_batch_phase, "last_batch"
        crash = LogEvent(kind=EventKind.CRASH, time=head.time, fields=fields, line="\n".join([head.line, *block[1:]]))
        events = [crash]
        if fields["oom"] and self._oom_since_crash is None:
            oom_fields = {k: v for k, v in fields.items() if k not in ("process", "oom")}
            events.insert(0, LogEvent(kind=EventKind.OOM, time=head.time, fields=oom_fields, line=crash.line))
        self._oom_since_crash = None
        return events

    def feed_all(self, lines: Iterable[str], now: float) -> list[LogEvent]:
        events: list[LogEvent] = []
        for line in lines:
            events.extend(self.feed(line, now))
        return events


@dataclass(frozen=True, slots=True, kw_only=True)
class Death:
    """Why a worker died, read from the last lines of its log."""

    cause: str  # "oom" | "crash" | "watchdog" | "kv_capacity" | "unknown"
    phase: str = "unknown"  # for "oom": "prefill" | "decode" | "unknown"
    detail: str = ""  # the exception or log line that says so
    started: bool = False  # whether the log shows the worker had become ready before it died


def classify_death(lines: Sequence[str], now: float = 0.0) -> Death:
    """Classify a dead worker from its log tail (a few hundred lines are plenty)."""
    follower = LogFollower()
    events = follower.feed_all(lines, now) + follower.flush(now)
    started = any(e.kind is EventKind.READY for e in events)
    ooms = [e for e in events if e.kind is EventKind.OOM]
    crashes = [e for e in events if e.kind is EventKind.CRASH]
    if ooms:
        last = ooms[-1]
        detail = str(crashes[-1].fields.get("exception", "")) if crashes else last.line
        return Death(cause="oom", phase=str(last.fields.get("phase", "unknown")), detail=detail or last.line, started=started)
    if crashes:
        last = crashes[-1]
        cause = "watchdog" if last.fields.get("cause") == "watchdog" else "crash"
        return Death(cause=cause, detail=str(last.fields.get("exception", last.line.splitlines()[0] if last.line else "")), started=started)
    kv = [e for e in events if e.kind is EventKind.KV_CAPACITY_ERROR]
    if kv and not started:
        return Death(cause="kv_capacity", detail=kv[-1].line, started=started)
    return Death(cause="unknown", detail=lines[-1].strip() if lines else "", started=started)
