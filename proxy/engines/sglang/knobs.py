"""SGLang's retunable arguments, behind the controller's engine-neutral knob names.

The controller moves ``conservativeness``, ``prefill_chunk``, ``max_running`` and
``memory_fraction``; this table says which ``ServerArgs`` field each one is, what SGLang does when
it is unset, and the values SGLang accepts (reference/sglang.md, section 4 and the tuning guide):

| knob | SGLang field | unset | range / ladder |
|---|---|---|---|
| conservativeness | ``schedule_conservativeness`` | 1.0 | >= 0 (the guide: 0.3 .. 1.3) |
| prefill_chunk | ``chunked_prefill_size`` | by GPU memory (2048..16384), start-up line | 512 .. 16384, ``-1`` disables |
| max_running | ``max_running_requests`` | from KV capacity, start-up line | >= 1 |
| memory_fraction | ``mem_fraction_static`` | from GPU memory (about 0.83 on an H100) | 0 .. 1, 0.01 steps |
| queue_order | ``schedule_policy`` | ``fcfs`` | ``lpm`` or ``fcfs`` (the controller's choice of SGLang's nine) |
| graph_max_bs | ``cuda_graph_max_bs_decode`` (0.5.x; ``cuda_graph_max_bs`` before) | by GPU memory and tp (8..512) | 1 .. 1024 |

``mem_fraction_static`` is not printed at start-up; when the policy leaves it unset the controller
reads it from ``/server_info`` (:func:`resolved_from_server_info`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.engines.base import Choice, Knob, KnobName

__all__ = ["KNOBS", "choice_args", "knobs", "resolved_from_server_info", "running_limit"]

KNOBS: Mapping[KnobName, Knob] = {
    KnobName.CONSERVATIVENESS: Knob(
        name=KnobName.CONSERVATIVENESS, arg="schedule_conservativeness", default=1.0, minimum=0.0, maximum=10.0
    ),
    KnobName.PREFILL_CHUNK: Knob(
        name=KnobName.PREFILL_CHUNK,
        arg="chunked_prefill_size",
        default=None,
        minimum=512,
        maximum=16384,
        integer=True,
        ladder=(512, 1024, 2048, 4096, 8192, 16384),
        resolved_field="chunked_prefill_size",
        disabled=-1,
    ),
    KnobName.MAX_RUNNING: Knob(
        name=KnobName.MAX_RUNNING,
        arg="max_running_requests",
        default=None,
        minimum=1,
        maximum=1_000_000,
        integer=True,
        resolved_field="max_running_requests",
    ),
    KnobName.MEMORY_FRACTION: Knob(
        name=KnobName.MEMORY_FRACTION,
        arg="mem_fraction_static",
        default=None,
        minimum=0.05,
        maximum=0.99,
        resolved_field="mem_fraction_static",
    ),
    KnobName.QUEUE_ORDER: Knob(
        name=KnobName.QUEUE_ORDER,
        arg="schedule_policy",
        default=None,
        minimum=0,
        maximum=0,
        choices=("lpm", "fcfs"),  # (by cached prefix, by arrival), as QUEUE_ORDER reads them
    ),
    KnobName.GRAPH_MAX_BS: Knob(
        name=KnobName.GRAPH_MAX_BS,
        arg="cuda_graph_max_bs_decode",
        default=None,
        minimum=1,
        maximum=1024,
        integer=True,
        ladder=(8, 32, 48, 160, 256, 384, 512, 768, 1024),  # the GPU tiers' defaults, and the guide's 512 / 768
        resolved_field="cuda_graph_max_bs_decode",
    ),
}


def choice_args(choice: Choice, args: Mapping[str, object]) -> dict[str, object] | None:
    """SGLang's flags for a person's choice (``--enable-torch-compile``, ``--quantization fp8``,
    ``--kv-cache-dtype fp8_e4m3``); None where ``args`` have it on already."""
    if choice is Choice.TORCH_COMPILE:
        return None if args.get("enable_torch_compile") else {"enable_torch_compile": True}
    if choice is Choice.FP8_WEIGHTS:
        return None if args.get("quantization") else {"quantization": "fp8"}
    if choice is Choice.FP8_KV_CACHE:
        return None if args.get("kv_cache_dtype") not in (None, "auto") else {"kv_cache_dtype": "fp8_e4m3"}
    return None  # chunked prefill: the planner prices the chunk size itself


def knobs() -> Mapping[KnobName, Knob]:
    """The table above (what ``EngineSpec.function("knobs", "knobs")`` returns)."""
    return KNOBS


def resolved_from_server_info(info: Mapping[str, Any]) -> dict[str, float]:
    """Values SGLang resolved for the knobs, from its ``GET /server_info`` JSON (resolved args at top level)."""
    out: dict[str, float] = {}
    for knob in KNOBS.values():
        value = info.get(knob.arg)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[knob.resolved_field or knob.arg] = value
    return out


def running_limit(info: Mapping[str, Any]) -> int | None:
    """The most requests SGLang runs at once, from its ``GET /server_info`` JSON: the schedulers' own
    figure (``effective_max_running_requests_per_dp`` of each DP rank's ``internal_states``, summed),
    else the resolved ``max_running_requests``; None when neither is a positive integer."""
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        per_rank = [_count(s.get("effective_max_running_requests_per_dp")) if isinstance(s, Mapping) else None
                    for s in states]  # fmt: skip
        known = [n for n in per_rank if n is not None]
        if len(known) == len(per_rank):
            return sum(known)
    return _count(info.get("max_running_requests"))


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_info_disagrees(
    info: Mapping[str, Any], *, args: Mapping[str, object], port: int, launched: float
) -> str | None:
    """Where ``GET /server_info`` (resolved args at top level, ``startup_time`` in wall seconds)
    says the server is not the one launched with ``args`` on ``port`` at ``launched``: another
    port, a start before the launch, or a numeric argument given at launch that it reports with
    another value (only numbers: a path or a name the server may rewrite as it resolves it)."""
    if info.get("port") not in (None, port):
        return f"it serves port {info.get('port')}, not {port}"
    started = info.get("startup_time")
    # a wall time (past 2001): a server that started before the launch is another one; a figure
    # that small is a duration (how long its start took), which says nothing of when
    if isinstance(started, (int, float)) and 1e9 < started < launched - 1.0:
        return "it started before the worker was launched"
    for name, want in args.items():
        have = info.get(name)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (want, have))
        if numbers and abs(float(have) - float(want)) > 1e-9 * max(1.0, abs(float(want))):  # type: ignore[arg-type]
            return f"its {name} is {have}, not {want}"
    return None
