"""vLLM's command-line flags in one place: the table a policy may set, and the argv builder.

vLLM derives each flag from an ``EngineArgs`` field: ``"--" + name.replace("_", "-")``. Its boolean
fields are ``BooleanOptionalAction`` flags (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``),
so a false value is written out rather than omitted. The server serves ``/metrics`` on its API port
without a flag; the supervisor adds only ``--host`` and ``--port``.

    >>> build_argv({"model": "m", "max_num_seqs": 24}, [], host="127.0.0.1", port=8001)
    ['--model', 'm', '--max-num-seqs', '24', '--host', '127.0.0.1', '--port', '8001']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.engines.flags import FlagSpec, FlagTable, flag_name, format_value, parse_flags
from proxy.engines.flags import spec as _f

__all__ = [
    "KNOWN_FLAGS",
    "REMOVED_FLAGS",
    "SUPERVISOR_FLAGS",
    "FlagSpec",
    "build_argv",
    "check_arg",
    "flag_name",
    "parse_argv_args",
]


_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")

# Field name -> spec, vLLM 0.32 (vllm/engine/arg_utils.py, vllm/config/*.py).
KNOWN_FLAGS: Mapping[str, FlagSpec] = {
    # model
    "model": _f("str"),
    "tokenizer": _f("str"),
    "served_model_name": _f("str"),
    "trust_remote_code": _f("bool"),
    "max_model_len": _f("int", minimum=1),
    "dtype": _f("str", *_DTYPES),
    "quantization": _f("str"),
    "seed": _f("int"),
    "enforce_eager": _f("bool"),
    # CUDA graphs (CompilationConfig, set from the command line in vLLM 0.11 and later)
    "max_cudagraph_capture_size": _f("int", minimum=1),
    "cudagraph_capture_sizes": _f("int_list", minimum=1),
    # cache
    "gpu_memory_utilization": _f("float", minimum=0.01, maximum=1.0),
    "kv_cache_memory_bytes": _f("int", minimum=1),
    "block_size": _f("int", minimum=1),
    "kv_cache_dtype": _f("str", *_KV_CACHE_DTYPES),
    "num_gpu_blocks_override": _f("int", minimum=1),
    "enable_prefix_caching": _f("bool"),
    # scheduler
    "max_num_seqs": _f("int", minimum=1),
    "max_num_batched_tokens": _f("int", minimum=1),
    "enable_chunked_prefill": _f("bool"),
    "scheduling_policy": _f("str", "fcfs", "priority"),
    # parallelism
    "tensor_parallel_size": _f("int", minimum=1),
    "pipeline_parallel_size": _f("int", minimum=1),
    "data_parallel_size": _f("int", minimum=1),
    # serving
    "api_key": _f("str"),
    "enable_server_load_tracking": _f("bool"),
}

# Flags the supervisor sets itself; a policy may not name them in engine.args.
SUPERVISOR_FLAGS: Mapping[str, FlagSpec] = {
    "host": _f("str"),
    "port": _f("int", minimum=0, maximum=65535),
}

# Names vLLM no longer accepts (or that would blind the proxy) -> what to write instead.
REMOVED_FLAGS: Mapping[str, str] = {
    "swap_space": "removed in vLLM V1 (no swap preemption); drop it",
    "disable_log_stats": "not allowed: the proxy reads vLLM's periodic stats line",
    "max_num_partial_prefills": "not accepted by vLLM 0.32's server parser",
}


TABLE = FlagTable(
    "vLLM",
    KNOWN_FLAGS,
    SUPERVISOR_FLAGS,
    REMOVED_FLAGS,
    secret=frozenset({"api_key"}),
    identity=frozenset({"model", "tokenizer", "served_model_name"}),
)


def check_arg(name: str, value: object, *, allow_sim: bool = False) -> str | None:
    """Why ``name = value`` is not a valid vLLM engine arg for a policy, or ``None`` if it is."""
    del allow_sim  # the simulated engine speaks SGLang
    return TABLE.check(name, value)


def placement_args(gpus_per_worker: int, model: str | None) -> dict[str, object]:
    """The flags of a worker placed on ``gpus_per_worker`` GPUs (its ``CUDA_VISIBLE_DEVICES``)
    serving ``model`` under that name: ``--tensor-parallel-size`` and ``--served-model-name``."""
    out: dict[str, object] = {"tensor_parallel_size": gpus_per_worker}
    if model is not None:
        out["served_model_name"] = model
    return out


def _bool_flag(name: str, value: bool) -> str:
    return flag_name(name) if value else "--no-" + name.replace("_", "-")


def build_argv(args: Mapping[str, object], extra_args: Sequence[str], *, host: str, port: int) -> list[str]:
    """The flags (no launcher) that start a vLLM OpenAI server with ``args`` on ``host:port``.

    ``args`` uses field names (underscores); ``None`` values are skipped; booleans become
    ``--flag`` / ``--no-flag``. ``extra_args`` are appended verbatim before ``--host``/``--port``,
    which are always last.
    """
    argv: list[str] = []
    for name, value in args.items():
        if name in SUPERVISOR_FLAGS:
            raise ValueError(f"engine arg {name!r} is set by the supervisor")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(_bool_flag(name, value))
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"engine arg {name!r}: empty list")
            argv.append(flag_name(name))
            argv.extend(format_value(v) for v in value)
        else:
            argv += [flag_name(name), format_value(value)]
    argv.extend(str(a) for a in extra_args)
    argv += ["--host", host, "--port", str(port)]
    return argv


def parse_argv_args(argv: Sequence[str]) -> dict[str, object]:
    """The inverse of :func:`build_argv`: ``["--max-num-seqs", "24", "--no-enable-prefix-caching"]``
    -> ``{"max_num_seqs": 24, "enable_prefix_caching": False}`` (numbers typed where they look like
    numbers; tokens before the first flag, a launcher, are skipped)."""
    out: dict[str, object] = {}
    for name, value in parse_flags(argv, TABLE.lookup).items():
        negated = name[3:] if name.startswith("no_") else None
        if negated is not None and value is True and KNOWN_FLAGS.get(negated, FlagSpec(type="")).type == "bool":
            out[negated] = False
        else:
            out[name] = value
    return out
