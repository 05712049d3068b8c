"""SGLang's log lines -> engine-neutral :class:`LogEvent` values.

Two layers:

* :func:`parse_line` is pure and reads one line: the periodic ``Decode batch`` / ``Prefill batch``
  statistics (every shape since 0.1.x), retractions (the 0.5.23 WARNING form and the older
  wordings), the start-up capacity line, readiness, the KV allocator's out-of-memory errors, the
  KV-pool-vs-context-length warning and crash heads (``Scheduler hit an exception``).
* :class:`LogFollower` keeps the little state a crash needs: the traceback after a crash head is
  what tells a CUDA OOM in prefill from one in decode. It collects the block until the next
  prefixed line (or :meth:`LogFollower.flush`) and emits one ``CRASH`` event, plus an ``OOM`` event
  when no allocator line had reported it. A device OOM is recognised in the wording of PyTorch,
  the CUDA runtime or driver, cuBLAS, NCCL and FlashInfer (``cause`` names the last four). The allocator's warning that a first try
  failed (it then retries) is no event, but explains a death nothing else explains.

:func:`classify_death` runs a fresh follower over the last lines of a dead worker's log.

Every line starts with ``[time{prefix}] ``, the prefix naming ranks (`` DP1 PP0 TP3 EP2``); the
ranks go into the event's fields. Field names are engine-neutral (``queue``, ``running``,
``token_usage``, ``gen_throughput``, ``retracted``, ``available_gpu_mem_gb``, ``phase``...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from proxy.engines.base import Death, EventKind, LogEvent, death_from_events

__all__ = ["Death", "LogFollower", "classify_death", "parse_line"]

Fields = dict[str, float | int | str | bool]

# Every SGLang log line starts with a bracketed prefix. Its shapes over versions
# (python/sglang/srt/utils.py configure_logger, and the managers that logged before it existed):
#   0.1.x   none, or "Rank 0: " inside the message (router/model_rpc.py)
#   0.2.x   "[gpu_id=0] " / "[gpu=0] " inside the message (managers/controller/tp_worker.py,
#           managers/tp_worker.py), later "[04:40:55 TP0] " (time only)
#   0.3.x+  "[2024-11-29 10:28:25 TP0] ", "[2026-09-13 16:06:05,123 DP1 TP0] ", "[2026-09-13 16:06:05] "
_PREFIX = re.compile(
    r"^\s*\[(?:(?P<stamp>(?:\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d(?:[.,]\d+)?)(?P<ranks>(?: [A-Z_]+\d+)*)"
    r"|gpu(?:_id)?=(?P<gpu>\d+))\]\s?"
)
_RANK = re.compile(r"([A-Z_]+?)(\d+)$")
_RANK_KEYS = {
    "TP": "tp_rank",
    "DP": "dp_rank",
    "PP": "pp_rank",
    "EP": "ep_rank",
    "ATTN_CP": "attn_cp_rank",
    "MOE_DP": "moe_dp_rank",
}

# The periodic statistics, over versions (the scheduler's log_prefill_stats / log_decode_stats, in
# managers/scheduler.py and since 0.5 managers/scheduler_metrics_mixin.py; before 0.3.3 in
# managers/tp_worker.py, before 0.1.15 in managers/router/model_rpc.py):
#   0.5.x   "Decode batch, #running-req: ..." / "Decode batch [4100], ..." / "Prefill batch, #new-seq: ..."
#   0.2-0.4 "Decode batch. #running-req: N, #token: N, token usage: x, [cuda graph: b, ]gen throughput
#           (token/s): y, [largest-len: 0, ]#queue-req: z[, ]"; "Prefill batch. #new-seq: N, #new-token: N,
#           #cached-token: N, [cache hit rate: x%, ]token usage: x, #running-req: N, #queue-req: N";
#           "Prefill batch(mixed #running-req: N). ..." (mixed chunked prefill, 0.2.x-0.3.x)
#   0.1.x   "#running-req: N, #token: N, token usage: x, [gen throughput (token/s): y, ]#queue-req: z" (no
#           head) and "new fill batch. #seq: N. #cached_token: N. #new_token: N. #remaining_req: N.
#           #running_req: N. tree_cache_hit_rate: x%." (fields separated by ". ")
_BATCH = re.compile(
    r"\b(?P<kind>Decode|Prefill) batch(?: \[(?P<iter>\d+)\])?(?:\(mixed #running-req: (?P<mixed>\d+)\))?[.,]\s*(?P<rest>.*)$"
)
_BARE_DECODE = "#running-req: "  # 0.1.x: the decode line is the statistics alone
_FILL_BATCH = re.compile(r"\bnew fill batch\. (?P<rest>.*)$")
_DOT_SEPARATED = re.compile(r"\.\s+")
# Retraction, over versions (scheduler.py update_running_batch / process_batch_result_decode):
#   0.5.23   WARNING "KV cache pool is full. Retract requests. #retracted_reqs: ..., #new_tokens_gained: ..."
#   0.4.10+  INFO "KV cache pool is full. Retract requests. #retracted_reqs: ..., #new_token_ratio: a -> b"
#   0.2-0.4  "Decode out of memory happened. #retracted_reqs: ..." (tp_worker.py forward_decode_batch)
#   0.1.x    "decode out of memory happened, #retracted_reqs: ..." (router/model_rpc.py)
_RETRACT = re.compile(
    r"(?P<head>KV cache pool is full\. Retract requests\.|Testing retraction\.|[Dd]ecode out of memory happened[.,])"
    r"\s*(?P<rest>.*)$"
)
_RATIO = re.compile(r"#new_token_ratio:\s*(?P<before>[-\d.eE+]+)\s*->\s*(?P<after>[-\d.eE+]+)")
# The resolved capacity at start-up, over versions: "max_total_num_tokens=..., chunked_prefill_size=...,
# max_prefill_tokens=..., max_running_requests=..., context_len=...[, available_gpu_mem=x GB]" (0.2+;
# available_gpu_mem since 0.4.x), "Rank 0: max_total_num_token=..., max_prefill_num_token=..., context_len=..."
# (0.1.x model_rpc.py; one build printed "Max_total_num_token"). Anchored at the message start: the KV leak
# check prints "Warning: available_size=N, max_total_num_token(s)=N" and is no start-up line.
_STARTUP = re.compile(r"^(?:Rank \d+: )?[Mm]ax_total_num_tokens?=\d+")
# "avail mem=x GB" ends the start-up steps' lines (Load weight end, "Memory pool end." of model_runner.py
# init_memory_pool, Capture cuda graph end; 0.2+): the last one before the capacity line is what the newer
# "available_gpu_mem=" of that line reports. Only LogFollower reads it; no event of its own.
_AVAIL_MEM = re.compile(r"\bavail mem=(?P<gb>\d+(?:\.\d+)?)\s*GB")
_KV_VS_CONTEXT = re.compile(r"KV pool holds (?P<kv>\d+) tokens, fewer than --context-length (?P<ctx>\d+)")
# The KV allocator's refusal ("Avaliable tokens" in 0.4.x, "Available tokens" later; the message is the same).
_ALLOC_OOM = re.compile(r"\b(?P<phase>Prefill|Decode) out of memory\. Try to lower your batch size")
_SLOTS_OOM = re.compile(r"alloc_req_slots runs out of memory")
# Crash heads: 0.4.x+ "Scheduler hit an exception: Traceback ..."; 0.3.x-0.4.0 the scheduler logged the
# traceback itself on a rank-prefixed line ("[2024-11-20 16:40:55 TP0] Traceback (most recent call last):");
# 0.2.x "Exception in ModelTpServer:" / "Exception in ControllerSingle:"; 0.1.x "Exception in ModelRpcClient:".
_EXCEPTION = re.compile(
    r"\b(?:(?P<who>Scheduler|DetokenizerManager|TokenizerManager|DataParallelController) hit an exception:?"
    r"|Exception in (?P<old>ModelTpServer|ModelRpcClient|ControllerSingle|ControllerMulti|run_scheduler_process):)"
    r"\s*(?P<rest>.*)$"
)
_TRACEBACK_HEAD = "Traceback (most recent call last):"
_OLD_PROCESS = {"ModelTpServer": "Scheduler", "ModelRpcClient": "Scheduler", "ControllerSingle": "Scheduler",
                "ControllerMulti": "DataParallelController", "run_scheduler_process": "Scheduler"}  # fmt: skip
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
    "cache hit rate": "cache_hit_rate",  # "12.34%" (0.2.x-0.4.0)
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
    # 0.1.x "new fill batch" keys
    "#seq": "new_seqs",
    "#cached_token": "cached_tokens",
    "#new_token": "new_tokens",
    "#remaining_req": "queue",
    "#running_req": "running",
    "tree_cache_hit_rate": "cache_hit_rate",
}
_GRAPH_KEYS = ("cuda graph", "cpu graph", "npu graph", "musa graph")
_USAGE_KEYS = ("token_usage", "full_token_usage", "swa_token_usage", "mamba_usage")

_STARTUP_KEYS: dict[str, str] = {
    "max_total_num_tokens": "max_total_tokens",
    "max_total_num_token": "max_total_tokens",  # 0.1.x
    "Max_total_num_token": "max_total_tokens",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_prefill_tokens": "max_prefill_tokens",
    "max_prefill_num_token": "max_prefill_tokens",  # 0.1.x
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
        pass
    if text.endswith("%"):  # "cache hit rate: 12.34%" -> 0.1234
        try:
            return round(float(text[:-1]) / 100.0, 6)
        except ValueError:
            pass
    return text


@lru_cache(maxsize=256)
def _rank_items(ranks: str, gpu: str | None) -> tuple[tuple[str, int], ...]:
    """The rank fields of a prefix (" DP1 TP3" -> dp_rank 1, tp_rank 3); a log has few distinct prefixes."""
    items: list[tuple[str, int]] = []
    for token in ranks.split():
        rank = _RANK.match(token)
        if rank and rank.group(1) in _RANK_KEYS:
            items.append((_RANK_KEYS[rank.group(1)], int(rank.group(2))))
    if gpu is not None:
        items.append(("gpu_id", int(gpu)))
    return tuple(items)


def _split_prefix(line: str) -> tuple[Fields, str, bool]:
    """(rank fields, message, whether the line carried SGLang's logger prefix)."""
    match = _PREFIX.match(line) if line[:1] == "[" or line[:1].isspace() else None
    if match is None:
        return {}, line.strip(), False
    return dict(_rank_items(match.group("ranks") or "", match.group("gpu"))), line[match.end() :].strip(), True


def _pairs(text: str, sep: str) -> Iterable[tuple[str, str]]:
    """``key<sep> value`` pieces of a comma-separated list; pieces without ``sep`` are skipped."""
    for piece in text.split(","):
        key, found, value = piece.partition(sep)
        if found and key.strip():
            yield key.strip(), value.strip()


def _batch_fields(phase: str, ranks: Fields, pieces: Iterable[str]) -> Fields:
    fields: Fields = {**ranks, "phase": phase}
    for piece in pieces:
        key, found, value = piece.partition(":")
        key = key.strip()
        if not found or not key:
            continue
        if key in _BATCH_KEYS:
            fields[_BATCH_KEYS[key]] = _number(value.strip().rstrip("."))
        elif key in _GRAPH_KEYS:
            fields["graph"] = value.strip() == "True"
    usages = [float(fields[k]) for k in _USAGE_KEYS if isinstance(fields.get(k), (int, float))]
    if usages:  # like sglang:token_usage, the fullest of the pools
        fields["token_usage"] = max(usages)
    return fields


def _batch_event(match: re.Match[str], ranks: Fields, now: float, line: str) -> LogEvent:
    fields = _batch_fields(match.group("kind").lower(), ranks, match.group("rest").split(","))
    if match.group("iter"):
        fields["iteration"] = int(match.group("iter"))
    if match.group("mixed"):
        fields["running"] = int(match.group("mixed"))
        fields["mixed"] = True
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


def _half_last_digit(text: str) -> float:
    """How far a printed figure may be from the true one: half its last printed digit ("1.09": 0.005)."""
    decimals = len(text.partition(".")[2])
    return 0.5 * 10.0**-decimals


def _startup_event(message: str, ranks: Fields, now: float, line: str) -> LogEvent:
    fields: Fields = dict(ranks)
    text = (
        message.split(": ", 1)[-1] if message.startswith("Rank ") else message
    )  # 0.1.x "Rank 0: max_total_num_token=..."
    for key, value in _pairs(text, "="):
        if key in _STARTUP_KEYS:
            fields[_STARTUP_KEYS[key]] = _number(value.removesuffix("GB").strip())
        if key == "available_gpu_mem":
            fields["available_gpu_mem_rounding_gb"] = _half_last_digit(value.removesuffix("GB").strip())
    if "available_cpu_mem_gb" in fields:
        fields["device"] = "cpu"
    return LogEvent(kind=EventKind.STARTUP, time=now, fields=fields, line=line)


def parse_line(line: str, now: float) -> LogEvent | None:
    """The event one log line reports, or ``None`` for a line the controller does not use.

    ``now`` is the monotonic time the line was read (the line's own wall-clock stamp is ignored).
    A crash head (``Scheduler hit an exception``, or an older version's) yields a ``CRASH`` event with
    ``phase`` "unknown": only :class:`LogFollower`, which reads the traceback that follows, can tell more.
    """
    line = line.rstrip("\r\n")
    ranks, message, prefixed = _split_prefix(line)
    return _parse_message(line, ranks, message, prefixed, now)


def _parse_message(line: str, ranks: Fields, message: str, prefixed: bool, now: float) -> LogEvent | None:
    # Each family is tried only when a substring it must contain is present: most lines of a busy
    # server (HTTP access lines, request logs) contain none of them and cost a few substring scans.
    if not message:
        return None
    fields: Fields
    if "batch" in message:
        if (batch := _BATCH.search(message)) is not None:
            return _batch_event(batch, ranks, now, line)
        if (fill := _FILL_BATCH.search(message)) is not None:
            fields = _batch_fields("prefill", ranks, _DOT_SEPARATED.split(fill.group("rest")))
            return LogEvent(kind=EventKind.BATCH_STATS, time=now, fields=fields, line=line)
    elif message.startswith(_BARE_DECODE) and "#queue-req" in message:
        return LogEvent(
            kind=EventKind.BATCH_STATS, time=now, fields=_batch_fields("decode", ranks, message.split(",")), line=line
        )
    if "emory" in message or "etract" in message:
        if (retract := _RETRACT.search(message)) is not None:
            return _retraction_event(retract, ranks, now, line)
        if (alloc := _ALLOC_OOM.search(message)) is not None:
            fields = {**ranks, "phase": alloc.group("phase").lower(), "cause": "kv_pool"}
            return LogEvent(kind=EventKind.OOM, time=now, fields=fields, line=line)
        if _SLOTS_OOM.search(message):
            # The request-slot pool is sized by --max-running-requests: the decode remedy applies.
            fields = {**ranks, "phase": "decode", "cause": "request_slots"}
            return LogEvent(kind=EventKind.OOM, time=now, fields=fields, line=line)
    if "num_token" in message and _STARTUP.search(message):
        return _startup_event(message, ranks, now, line)
    if READY_MARKER in message:
        return LogEvent(kind=EventKind.READY, time=now, fields=dict(ranks), line=line)
    if "KV pool holds" in message and (kv := _KV_VS_CONTEXT.search(message)) is not None:
        fields = {**ranks, "kv_tokens": int(kv.group("kv")), "context_len": int(kv.group("ctx")), "fatal": False}
        return LogEvent(kind=EventKind.KV_CAPACITY_ERROR, time=now, fields=fields, line=line)
    if "xception" in message and (exc := _EXCEPTION.search(message)) is not None:
        who = exc.group("who") or _OLD_PROCESS[exc.group("old")]
        fields = {**ranks, "process": who, "phase": "unknown", "oom": False}
        return LogEvent(kind=EventKind.CRASH, time=now, fields=fields, line=line)
    if prefixed and "tp_rank" in ranks and message == _TRACEBACK_HEAD:
        fields = {**ranks, "process": "Scheduler", "phase": "unknown", "oom": False}
        return LogEvent(kind=EventKind.CRASH, time=now, fields=fields, line=line)
    if "atchdog" in message and _WATCHDOG.search(message):
        fields = {**ranks, "cause": "watchdog", "phase": "unknown", "oom": False}
        return LogEvent(kind=EventKind.CRASH, time=now, fields=fields, line=line)
    return None


# -- crashes: a traceback spans many lines ------------------------------------------------------

# Out of memory on the device, in every wording that reaches a log:
#   PyTorch's caching allocator  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0
#                                has a total capacity of ..." (torch >= 2.5), "torch.cuda.OutOfMemoryError: ..."
#                                (2.0-2.4), "RuntimeError: CUDA out of memory. Tried to allocate ..." (< 1.13)
#   the CUDA runtime / driver    "CUDA error: out of memory" (+ "CUDA kernel errors might be asynchronously
#                                reported ..."), "cudaErrorMemoryAllocation"; "CUDA driver error: out of memory"
#                                (PyTorch's driver-API check, as with the allocator's expandable segments)
#   cuBLAS                       "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
#   NCCL                         "Cuda failure 'out of memory'", "Cuda failure 2 'out of memory'"
#   FlashInfer                   "Failed to allocate memory for batch_prefill_tmp_v with size N and alignment 16 in
#                                AlignedAllocator" (include/flashinfer/allocator.h), "Out of workspace memory in
#                                AlignedAlloactor" (its older spelling), "CUDA Error: out of memory (2) .../handler.cuh"
_DEVICE_OOM = re.compile(
    r"torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA [Ee]rror: out of memory|CUDA driver error: out of memory"
    r"|cudaErrorMemoryAllocation"
    r"|CUBLAS_STATUS_ALLOC_FAILED|Cuda failure (?:\d+ )?'out of memory'"
    r"|Failed to allocate memory for \w+ with size \d+ and alignment \d+ in AlignedAllocator"
    r"|Out of workspace memory in AlignedAllo(?:ca|ac)tor"
)
# PyTorch's caching allocator when a device allocation fails ("[W910 23:40:43.144601916 CUDACachingAllocator.cpp:3933]
# memory allocation failed with OOM on device 0 while trying to allocate N bytes (free: F, total: T)"): a warning,
# then it frees its cache and tries again (OutOfMemoryError only if that fails too). No event; it explains a death
# whose log says nothing else (classify_death).
_ALLOCATOR_RETRY = "memory allocation failed with OOM"
_OOM_CAUSES: tuple[tuple[str, str], ...] = (  # substring of the OOM line -> cause, the first found wins
    ("AlignedAllo", "flashinfer_workspace"),
    ("flashinfer/", "flashinfer_workspace"),  # "CUDA Error: out of memory (2) .../flashinfer/handler.cuh"
    ("CUBLAS_STATUS_ALLOC_FAILED", "cublas"),
    ("Cuda failure", "nccl"),
)
_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)|RuntimeError|AssertionError)\b.*")
# Markers of the phase a traceback died in, from SGLang's scheduler / model-runner function names over
# versions (0.1.x model_rpc.py forward_fill_batch / forward_decode_batch, 0.2.x tp_worker.py
# forward_prefill_batch / get_new_prefill_batch, 0.3+ scheduler.py), the allocator's own messages and
# FlashInfer's per-phase buffers. The innermost (last) marker wins.
_PHASE_MARKERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Prefill out of memory|forward_extend|prepare_for_extend|alloc_for_extend|get_new_batch_prefill|process_batch_result_prefill|chunked_prefill"
                r"|forward_prefill_batch|forward_fill_batch|get_new_prefill_batch|get_new_fill_batch|batch_prefill_tmp|BatchPrefillWith"), "prefill"),
    (re.compile(r"Decode out of memory|alloc_req_slots|forward_decode|prepare_for_decode|alloc_for_decode|update_running_batch|process_batch_result_decode"
                r"|batch_decode_tmp|BatchDecodeWith"), "decode"),
)  # fmt: skip
_MAX_BLOCK = 400  # lines kept of one traceback
# An unprefixed line that is SGLang's own statistics ends a traceback block (0.1.x logged without a prefix).
_BLOCK_ENDS = ("Decode batch", "Prefill batch", "new fill batch", _BARE_DECODE, READY_MARKER)


def _traceback_fields(lines: Sequence[str]) -> Fields:
    """What a traceback says: the exception line, whether it was an OOM, and in which phase."""
    fields: Fields = {"oom": False, "phase": "unknown"}
    exception = ""
    device_oom = ""
    for text in lines:
        stripped = text.strip()
        if _EXC_LINE.match(stripped):
            exception = stripped
        if _DEVICE_OOM.search(stripped):
            fields["oom"] = True
            device_oom = device_oom or stripped
        elif _ALLOC_OOM.search(stripped) or _SLOTS_OOM.search(stripped):
            fields["oom"] = True
        for pattern, phase in _PHASE_MARKERS:
            if pattern.search(stripped):
                fields["phase"] = phase
    if exception:
        fields["exception"] = exception[:300]
    elif device_oom:
        fields["exception"] = device_oom[:300]
    if _SLOTS_OOM.search(" ".join(lines)):
        fields["cause"] = "request_slots"
    elif any(_ALLOC_OOM.search(t) for t in lines):
        fields["cause"] = "kv_pool"
    elif device_oom:
        fields["cause"] = next((cause for marker, cause in _OOM_CAUSES if marker in device_oom), "device_memory")
    return fields


@dataclass(slots=True)
class LogFollower:
    """Turns a worker's log, line by line, into events; crash tracebacks are read as one block.

    ``feed`` returns the events a line completes (often none, sometimes two: the end of a
    traceback block and the line that ended it). ``flush`` ends a pending block (call it when the
    process exits). The phase of the last ``Prefill batch`` / ``Decode batch`` line is the fallback
    for a crash whose traceback names no phase (``phase_source`` says which was used). A ``STARTUP``
    event without ``available_gpu_mem_gb`` (versions before 0.4.x) gets the last ``avail mem=`` the
    start-up printed (``available_mem_source`` says so).
    """

    _block: list[str] | None = None
    _block_head: LogEvent | None = None
    _last_batch_phase: str | None = None
    _oom_since_crash: str | None = None  # phase of an OOM already reported for this incident
    _avail_mem_gb: float | None = None  # the last "avail mem=x GB" of the current start-up
    _device_oom: str | None = None  # a device OOM printed outside a traceback (FlashInfer's C++ side, NCCL)
    allocator_retry: str | None = None  # the caching allocator's last failed first try since the server was ready

    def feed(self, line: str, now: float) -> list[LogEvent]:
        line = line.rstrip("\r\n")
        events: list[LogEvent] = []
        ranks, message, prefixed = _split_prefix(line)
        if self._block is not None:
            if not prefixed and len(self._block) < _MAX_BLOCK and not message.startswith(_BLOCK_ENDS):
                self._block.append(line)
                return events
            events.extend(self.flush(now))
        if _ALLOCATOR_RETRY in message:
            self.allocator_retry = line
            return events
        if "avail mem=" in message and (mem := _AVAIL_MEM.search(message)) is not None:
            self._avail_mem_gb = float(mem.group("gb"))
        if ("emory" in message or "ALLOC_FAILED" in message or "Cuda failure" in message) and _DEVICE_OOM.search(
            message
        ):
            self._device_oom = message  # the traceback that follows (or the exit) says what it was
            return events
        event = _parse_message(line, ranks, message, prefixed, now)
        if event is None:
            return events
        if event.kind is EventKind.CRASH and event.fields.get("process") is not None:
            self._block = [message]
            self._block_head = event
            return events
        if event.kind is EventKind.BATCH_STATS:
            self._last_batch_phase = str(event.fields.get("phase"))
        elif event.kind is EventKind.OOM:
            self._oom_since_crash = str(event.fields.get("phase"))
        elif event.kind is EventKind.READY:
            self._oom_since_crash = None
            self._avail_mem_gb = None
            self._device_oom = None
            self.allocator_retry = None
        elif event.kind is EventKind.STARTUP and "max_total_tokens" in event.fields:
            event = self._with_avail_mem(event)
        events.append(event)
        return events

    def _with_avail_mem(self, startup: LogEvent) -> LogEvent:
        """The capacity line of a version that does not print ``available_gpu_mem``, with the start-up's last ``avail mem``."""
        if self._avail_mem_gb is None or {"available_gpu_mem_gb", "available_cpu_mem_gb"} & startup.fields.keys():
            return startup
        fields = {
            **startup.fields,
            "available_gpu_mem_gb": self._avail_mem_gb,
            "available_mem_source": "avail_mem_line",
        }
        return LogEvent(kind=startup.kind, time=startup.time, fields=fields, line=startup.line)

    def flush(self, now: float) -> list[LogEvent]:
        """End a pending traceback block: its ``CRASH`` event (and ``OOM`` event) come out now.

        A device OOM printed outside a traceback belongs to the block that follows it; with no block, it
        comes out alone as an ``OOM`` event.
        """
        pending, self._device_oom = ([self._device_oom] if self._device_oom is not None else []), None
        if self._block is None or self._block_head is None:
            return [self._lone_oom(pending[0], now)] if pending else []
        head, block = self._block_head, self._block
        self._block, self._block_head = None, None
        fields: Fields = {**head.fields, **_traceback_fields(pending + block)}
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

    def _lone_oom(self, line: str, now: float) -> LogEvent:
        fields = {k: v for k, v in _traceback_fields([line]).items() if k != "oom"}
        if fields["phase"] != "unknown":
            fields["phase_source"] = "traceback"
        elif self._last_batch_phase is not None:
            fields["phase"], fields["phase_source"] = self._last_batch_phase, "last_batch"
        return LogEvent(kind=EventKind.OOM, time=now, fields=fields, line=line)

    def feed_all(self, lines: Iterable[str], now: float) -> list[LogEvent]:
        events: list[LogEvent] = []
        for line in lines:
            events.extend(self.feed(line, now))
        return events


def classify_death(lines: Sequence[str], now: float = 0.0) -> Death:
    """Classify a dead worker from its log tail (a few hundred lines are plenty)."""
    follower = LogFollower()
    death = death_from_events(follower.feed_all(lines, now) + follower.flush(now), lines)
    if death.cause == "unknown" and follower.allocator_retry is not None:
        # nothing else says why: the allocator's failed try is the last word on device memory before the end
        return Death(cause="oom", detail=follower.allocator_retry, started=death.started)
    return death
