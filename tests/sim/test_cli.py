"""The command line: SGLang's flag names, the proxy's argv builder, and the resolved config."""

from __future__ import annotations

import pytest

from proxy.engines.sglang.argv import KNOWN_FLAGS, build_argv
from proxy.sim.cli import build_parser, resolve_config

SAMPLE = {"bool": True, "int": 8, "float": 0.5, "int_list": [1, 2, 4], "str": "x"}


def _value(name: str):
    spec = KNOWN_FLAGS[name]
    if spec.choices:
        return spec.choices[0]
    return SAMPLE[spec.type]


def test_every_flag_the_proxy_may_set_parses() -> None:
    args = {name: _value(name) for name in KNOWN_FLAGS}
    ns = build_parser().parse_args(build_argv(args, ["--sim-time-scale", "10"], host="127.0.0.1", port=0))
    assert ns.enable_metrics and ns.port == 0 and ns.sim_time_scale == 10.0
    assert ns.schedule_conservativeness == 0.5 and ns.max_running_requests == 8


def test_a_typical_worker_argv_resolves() -> None:
    argv = build_argv(
        {
            "model_path": "meta-llama/Llama-3.1-8B-Instruct",
            "schedule_conservativeness": 0.3,
            "max_running_requests": 128,
            "chunked_prefill_size": 4096,
            "schedule_policy": "lpm",
            "cuda_graph_max_bs_decode": 64,
            "mem_fraction_static": 0.85,
            "tp_size": 1,
            "log_level": "warning",
            "trust_remote_code": True,
        },
        ["--sim-gpu", "a100-80gb"],
        host="127.0.0.1",
        port=31001,
    )
    cfg = resolve_config(build_parser().parse_args(argv))
    assert (cfg.schedule_conservativeness, cfg.max_running_requests, cfg.chunked_prefill_size) == (0.3, 128, 4096)
    assert cfg.cuda_graph_max_bs_decode == 64 and cfg.gpu.name == "a100-80gb" and cfg.port == 31001
    assert cfg.enable_metrics and cfg.schedule_policy == "lpm"
    assert cfg.server_args["max_running_requests"] == 128


def test_sglang_defaults() -> None:
    cfg = resolve_config(build_parser().parse_args([]))
    assert (cfg.host, cfg.port, cfg.schedule_policy, cfg.decode_log_interval) == ("127.0.0.1", 30000, "fcfs", 40)
    assert cfg.max_prefill_tokens == 16384 and cfg.context_len == 131072 and not cfg.enable_metrics
    assert cfg.served_model_name == cfg.model_path == "meta-llama/Llama-3.1-8B-Instruct"


def test_model_path_is_free_text_and_chunking_can_be_disabled() -> None:
    cfg = resolve_config(build_parser().parse_args(["--model", "/models/whatever", "--chunked-prefill-size", "-1"]))
    assert cfg.model_path == "/models/whatever" and cfg.model.name == "llama-3.1-8b"
    assert cfg.chunked_prefill_size is None


@pytest.mark.parametrize("argv", [["--cuda-graph-max-bs", "8"], ["--no-such-flag"], ["--schedule-policy", "sjf"]])
def test_what_sglang_rejects_is_rejected(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
