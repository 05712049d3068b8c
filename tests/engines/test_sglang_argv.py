"""The SGLang argv builder, its inverse, and the flag checks the policy relies on."""

from __future__ import annotations

import pytest

from proxy.engines.sglang.argv import KNOWN_FLAGS, build_argv, check_arg, flag_name, parse_argv_args


def test_build_argv_flags_then_extra_then_host_port_metrics() -> None:
    argv = build_argv(
        {
            "model_path": "/models/llama",
            "tp_size": 2,
            "schedule_conservativeness": 0.3,
            "enable_cache_report": True,
            "enable_priority_scheduling": False,
            "cuda_graph_bs_decode": [1, 2, 4, 8],
        },
        ["--attn-dp-size", "2"],
        host="127.0.0.1",
        port=30001,
    )
    assert argv == [
        "--model-path", "/models/llama", "--tp-size", "2", "--schedule-conservativeness", "0.3",
        "--enable-cache-report", "--cuda-graph-bs-decode", "1", "2", "4", "8",
        "--attn-dp-size", "2", "--host", "127.0.0.1", "--port", "30001", "--enable-metrics",
    ]  # fmt: skip


def test_enable_metrics_is_not_doubled() -> None:
    assert build_argv({"enable_metrics": True}, [], host="h", port=1).count("--enable-metrics") == 1


@pytest.mark.parametrize("name", ["host", "port"])
def test_build_argv_refuses_supervisor_flags(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        build_argv({name: "x"}, [], host="h", port=1)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param({"model_path": "m", "max_running_requests": 256, "mem_fraction_static": 0.83}, id="scalars"),
        pytest.param(
            {"chunked_prefill_size": -1, "schedule_policy": "lpm", "trust_remote_code": True}, id="negative-and-bool"
        ),
        pytest.param({"cuda_graph_bs_prefill": [1, 16], "watchdog_timeout": 600.0, "log_level": "debug"}, id="list"),
        pytest.param({"sim_time_scale": 10, "sim_mode": "fast", "sim_ratio": 0.5}, id="unknown-guessed"),
    ],
)
def test_round_trip(args: dict[str, object]) -> None:
    parsed = parse_argv_args(build_argv(args, [], host="127.0.0.1", port=30000))
    assert parsed == {**args, "host": "127.0.0.1", "port": 30000, "enable_metrics": True}


def test_parse_skips_the_launcher_and_reads_equals() -> None:
    argv = ["python3", "-m", "sglang.launch_server", "--model-path=/m", "--tp-size", "2", "--disable-radix-cache"]
    assert parse_argv_args(argv) == {"model_path": "/m", "tp_size": 2, "disable_radix_cache": True}


def test_false_bool_is_omitted_so_it_does_not_round_trip() -> None:
    assert parse_argv_args(build_argv({"trust_remote_code": False}, [], host="h", port=1)) == {
        "host": "h",
        "port": 1,
        "enable_metrics": True,
    }


def test_flag_names_follow_sglang_rule() -> None:
    assert flag_name("cuda_graph_max_bs_decode") == "--cuda-graph-max-bs-decode"
    for name in KNOWN_FLAGS:
        assert name == name.lower() and " " not in name and not name.startswith("-")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("max_running_requests", 256, None),
        ("schedule_conservativeness", 1, None),  # an int is a fine float
        ("mem_fraction_static", 0.88, None),
        ("cuda_graph_bs_decode", [1, 2, 4], None),
        ("enable_cache_report", True, None),
        ("schedule_policy", "routing-key", None),
        ("max_running_requests", 2.5, "expected an integer"),
        ("max_running_requests", True, "expected an integer"),
        ("max_running_requests", 0, "must be >= 1"),
        ("schedule_conservativeness", -0.1, "must be >= 0"),
        ("mem_fraction_static", 1.5, "must be <= 1"),
        ("enable_cache_report", "yes", "expected true or false"),
        ("schedule_policy", "lifo", "expected one of lpm, random, fcfs"),
        ("cuda_graph_bs_decode", [], "non-empty list"),
        ("cuda_graph_bs_decode", [1, "2"], "expected an integer"),
        ("model_path", 3, "expected a string"),
        ("cuda_graph_max_bs", 256, "use cuda_graph_max_bs_decode"),
        ("max_runing_requests", 8, "did you mean 'max_running_requests'"),
        ("port", 1234, "set by the supervisor"),
        ("enable_metrics", False, "always enabled"),
        ("sim_time_scale", 10, "unknown SGLang flag --sim-time-scale"),
    ],
)
def test_check_arg(name: str, value: object, expected: str | None) -> None:
    problem = check_arg(name, value)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_sim_names_only_for_the_simulator() -> None:
    assert check_arg("sim_time_scale", 10, allow_sim=True) is None
    assert check_arg("sim_time_scale", {"a": 1}, allow_sim=True) is not None
