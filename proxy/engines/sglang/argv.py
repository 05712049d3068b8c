"""SGLang's command-line flags in one place: the table the policy may set, and the argv builder.

SGLang 0.5.23 derives each CLI flag from a ``ServerArgs`` field: ``"--" + name.replace("_", "-")``.
Booleans are ``store_true`` flags (bare when true, absent when false); ``List[int]`` fields take
``nargs="+"`` (``--cuda-graph-bs-decode 1 2 4 8``). :data:`KNOWN_FLAGS` lists the fields an operator
may set from a policy file, with the type and choices SGLang's own parser applies, so a policy is
judged before a worker is ever started.

    >>> build_argv({"model_path": "m", "enable_cache_report": True}, [], host="127.0.0.1", port=30001)
    ['--model-path', 'm', '--enable-cache-report', '--host', '127.0.0.1', '--port', '30001', '--enable-metrics']

The simulated engine (``pacer sim``) takes the same flags plus its own ``--sim-*`` ones; those are
accepted only when ``allow_sim=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.engines.flags import FlagSpec, FlagTable, flag_name, format_value, parse_flags
from proxy.engines.flags import spec as _f

__all__ = [
    "KNOWN_FLAGS",
    "REMOVED_FLAGS",
    "SCHEDULE_POLICIES",
    "SUPERVISOR_FLAGS",
    "FlagSpec",
    "build_argv",
    "check_arg",
    "flag_name",
    "parse_argv_args",
]


# past this many waiting, lpm computes no prefix matches and the queue is served in arrival order
# (SchedulePolicy._determine_active_policy, managers/schedule_policy.py: "the expensive prefix matching")
LPM_QUEUE_LIMIT = 128

SCHEDULE_POLICIES = (  # ServerArgs.schedule_policy's choices
    "lpm",
    "random",
    "fcfs",
    "dfs-weight",
    "lof",
    "priority",
    "routing-key",
    "hrrn",
    "shortest-prefill-first",
)
_QUANTIZATIONS = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8",
    "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors",
    "modelslim", "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8", "unquant",
    "humming",
)  # fmt: skip
_KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")
_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_GRAPH_BACKENDS = ("full", "breakable", "disabled")

# Field name -> spec, SGLang 0.5.23 (python/sglang/srt/arg_groups/fields/*.py).
KNOWN_FLAGS: Mapping[str, FlagSpec] = {
    # model
    "model_path": _f("str"),
    "tokenizer_path": _f("str"),
    "tokenizer_mode": _f("str", "auto", "slow"),
    "served_model_name": _f("str"),
    "trust_remote_code": _f("bool"),
    "context_length": _f("int", minimum=1),
    "dtype": _f("str", *_DTYPES),
    "kv_cache_dtype": _f("str", *_KV_CACHE_DTYPES),
    "quantization": _f("str", *_QUANTIZATIONS),
    # serving
    "api_key": _f("str"),
    "admin_api_key": _f("str"),
    "enable_cache_report": _f("bool"),
    "incremental_streaming_output": _f("bool"),
    "stream_interval": _f("int", minimum=1),
    # parallelism
    "tp_size": _f("int", minimum=1),
    "dp_size": _f("int", minimum=1),
    "pp_size": _f("int", minimum=1),
    # memory and scheduling
    "mem_fraction_static": _f("float", minimum=0.0, maximum=1.0),
    "max_running_requests": _f("int", minimum=1),
    "max_queued_requests": _f("int", minimum=1),
    "max_total_tokens": _f("int", minimum=1),
    "chunked_prefill_size": _f("int", minimum=-1),  # -1 disables chunked prefill
    "max_prefill_tokens": _f("int", minimum=1),
    "prefill_max_requests": _f("int", minimum=1),
    "page_size": _f("int", minimum=1),
    "schedule_policy": _f("str", *SCHEDULE_POLICIES),
    "schedule_conservativeness": _f("float", minimum=0.0),
    "retraction_policy": _f("str", "length", "priority"),
    "enable_priority_scheduling": _f("bool"),
    "disable_priority_preemption": _f("bool"),
    "schedule_low_priority_values_first": _f("bool"),
    "default_priority_value": _f("int"),
    "priority_scheduling_preemption_threshold": _f("int", minimum=0),
    "disable_radix_cache": _f("bool"),
    "disable_overlap_schedule": _f("bool"),
    "enable_mixed_chunk": _f("bool"),
    "num_continuous_decode_steps": _f("int", minimum=1),
    # execution
    "cuda_graph_max_bs_decode": _f("int", minimum=1),
    "cuda_graph_max_bs_prefill": _f("int", minimum=1),
    "cuda_graph_bs_decode": _f("int_list", minimum=1),
    "cuda_graph_bs_prefill": _f("int_list", minimum=1),
    "cuda_graph_backend_decode": _f("str", *_GRAPH_BACKENDS),
    "cuda_graph_backend_prefill": _f("str", *_GRAPH_BACKENDS),
    "enable_torch_compile": _f("bool"),
    "torch_compile_max_bs": _f("int", minimum=1),
    "random_seed": _f("int"),
    "watchdog_timeout": _f("float", minimum=0.0),
    "soft_watchdog_timeout": _f("float", minimum=0.0),
    # observability
    "log_level": _f("str"),
    "log_level_http": _f("str"),
    "log_requests": _f("bool"),
    "decode_log_interval": _f("int", minimum=1),
    "enable_metrics_for_all_schedulers": _f("bool"),
}

# Flags the supervisor sets itself; a policy may not name them in engine.args.
SUPERVISOR_FLAGS: Mapping[str, FlagSpec] = {
    "host": _f("str"),
    "port": _f("int", minimum=0, maximum=65535),
    "enable_metrics": _f("bool"),
}

# Names SGLang no longer accepts -> what to write instead.
REMOVED_FLAGS: Mapping[str, str] = {
    "cuda_graph_max_bs": (
        "removed in SGLang 0.5.x (split in two; 0.5.23 rejects it as ambiguous): "
        "use cuda_graph_max_bs_decode (and cuda_graph_max_bs_prefill)"
    ),
    "disable_cuda_graph": 'deprecated in SGLang 0.5.x: use cuda_graph_backend_decode = "disabled" (and _prefill)',
    "enable_dp_attention": "deprecated in SGLang 0.5.x: use attn_dp_size through engine.extra_args",
}

TABLE = FlagTable(
    "SGLang",
    KNOWN_FLAGS,
    SUPERVISOR_FLAGS,
    REMOVED_FLAGS,
    secret=frozenset({"api_key", "admin_api_key"}),
    identity=frozenset({"model_path", "tokenizer_path", "served_model_name"}),
)

_SIM_PREFIX = "sim_"


def check_arg(name: str, value: object, *, allow_sim: bool = False) -> str | None:
    """Why ``name = value`` is not a valid engine arg for a policy, or ``None`` if it is.

    ``allow_sim`` admits the simulated engine's own ``sim_*`` names (scalars or lists of scalars).
    """
    if name == "enable_metrics":
        return None if value is True else "metrics are always enabled (the proxy paces by them); remove it"
    if allow_sim and name.startswith(_SIM_PREFIX):
        ok = _is_scalar(value) or (isinstance(value, list) and value and all(_is_scalar(v) for v in value))
        return None if ok else "expected a number, string, boolean or a non-empty list of them"
    return TABLE.check(name, value)


def placement_args(gpus_per_worker: int, model: str | None) -> dict[str, object]:
    """The flags of a worker placed on ``gpus_per_worker`` GPUs (its ``CUDA_VISIBLE_DEVICES``, so
    SGLang's ``--base-gpu-id`` stays 0) serving ``model`` under that name: ``--tp-size`` and
    ``--served-model-name``. Data parallelism is the pool's worker count (one process each), so
    the proxy, not ``--dp-size``, spreads the load over the replicas."""
    out: dict[str, object] = {"tp_size": gpus_per_worker}
    if model is not None:
        out["served_model_name"] = model
    return out


def _is_scalar(value: object) -> bool:
    return isinstance(value, (str, int, float, bool))


def build_argv(args: Mapping[str, object], extra_args: Sequence[str], *, host: str, port: int) -> list[str]:
    """The flags (no launcher) that start an SGLang server with ``args`` on ``host:port``.

    ``args`` uses field names (underscores). Booleans become bare flags when true and are omitted
    when false; lists become one flag followed by its values. ``extra_args`` are appended verbatim
    before ``--host``/``--port``/``--enable-metrics``, which are always last.
    """
    argv: list[str] = []
    for name, value in args.items():
        if name in ("host", "port"):
            raise ValueError(f"engine arg {name!r} is set by the supervisor")
        if name == "enable_metrics":
            continue  # always added below
        if isinstance(value, bool):
            if value:
                argv.append(flag_name(name))
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"engine arg {name!r}: empty list")
            argv.append(flag_name(name))
            argv.extend(format_value(v) for v in value)
        elif value is None:
            continue
        else:
            argv += [flag_name(name), format_value(value)]
    argv.extend(str(a) for a in extra_args)
    argv += ["--host", host, "--port", str(port), "--enable-metrics"]
    return argv


def parse_argv_args(argv: Sequence[str]) -> dict[str, object]:
    """The inverse of :func:`build_argv`: ``["--tp-size", "2", "--trust-remote-code"]`` -> ``{"tp_size": 2, "trust_remote_code": True}``.

    Values are typed by :data:`KNOWN_FLAGS` (see :func:`proxy.engines.flags.parse_flags`).
    """
    return parse_flags(argv, TABLE.lookup)
