"""The vLLM argv builder and flag checks (the real parser judges them in tests/real)."""

from __future__ import annotations

import pytest

from proxy.engines.vllm.argv import build_argv, check_arg, parse_argv_args


def test_build_argv_knobs_then_extra_then_host_port() -> None:
    argv = build_argv(
        {
            "model": "/m",
            "max_num_seqs": 24,
            "gpu_memory_utilization": 0.85,
            "enable_prefix_caching": False,
            "seed": None,
        },
        ["--num-gpu-blocks-override", "64"],
        host="127.0.0.1",
        port=8123,
    )
    assert argv == [
        "--model", "/m", "--max-num-seqs", "24", "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching",
        "--num-gpu-blocks-override", "64", "--host", "127.0.0.1", "--port", "8123",
    ]  # fmt: skip


def test_build_argv_round_trips_through_parse() -> None:
    args = {"model": "/m", "max_num_seqs": 24, "max_num_batched_tokens": 2048, "block_size": 16, "dtype": "bfloat16",
            "trust_remote_code": True, "enable_prefix_caching": False, "gpu_memory_utilization": 0.85}  # fmt: skip
    parsed = parse_argv_args(
        ["python3", "-m", "vllm.entrypoints.openai.api_server", *build_argv(args, [], host="h", port=1)]
    )
    assert parsed == {**args, "host": "h", "port": 1}


@pytest.mark.parametrize("name", ["host", "port"])
def test_supervisor_flags_refused(name: str) -> None:
    with pytest.raises(ValueError, match="supervisor"):
        build_argv({name: 1}, [], host="h", port=1)
    assert "supervisor" in (check_arg(name, 1) or "")


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("max_num_seqs", 0, ">= 1"),
        ("max_num_seqs", 2.5, "integer"),
        ("gpu_memory_utilization", 1.5, "<= 1"),
        ("kv_cache_dtype", "int3", "expected one of"),
        ("enable_prefix_caching", "yes", "true or false"),
        ("max_num_sequences", 8, "did you mean 'max_num_seqs'"),
        ("swap_space", 4, "removed"),
        ("disable_log_stats", True, "stats line"),
    ],
)
def test_check_arg_problems(name: str, value: object, problem: str) -> None:
    assert problem in (check_arg(name, value) or "")


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_num_seqs", 24), ("gpu_memory_utilization", 0.9), ("kv_cache_dtype", "fp8"), ("max_model_len", 1024),
     ("num_gpu_blocks_override", 64), ("enable_chunked_prefill", True)],
)  # fmt: skip
def test_check_arg_accepts(name: str, value: object) -> None:
    assert check_arg(name, value) is None
