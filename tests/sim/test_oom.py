"""Activation memory: a prefill chunk or an eager decode batch larger than what is left dies."""

from __future__ import annotations

from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate
from tests.sim.helpers import config

# RTX 3080 10 GB, Llama-3.1-8B in fp8 (as in the vLLM seed's experiments), static fraction 0.9:
# about 0.5 GB stays free for activations.
SMALL = ("--sim-gpu", "rtx3080-10gb", "--quantization", "fp8", "--mem-fraction-static", "0.9")


def test_undersized_gpu_large_chunk_dies_in_prefill() -> None:
    cfg = config(*SMALL, "--chunked-prefill-size", "8192")
    assert cfg.memory.available_mib < 8192 * cfg.model.prefill_act_mib_per_token
    res = simulate(cfg, [RequestSpec(prompt_len=6000, max_new_tokens=16)])
    assert res.oom == "prefill" and res.finished == 0


def test_smaller_chunk_survives_the_same_prompt() -> None:
    cfg = config(*SMALL, "--chunked-prefill-size", "1024")
    res = simulate(cfg, [RequestSpec(prompt_len=6000, max_new_tokens=16)])
    assert res.oom is None and res.finished == 1


def test_too_many_eager_decodes_die_in_decode() -> None:
    argv = ("--mem-fraction-static", "0.95", "--cuda-graph-max-bs-decode", "8")
    wl = [RequestSpec(prompt_len=40, max_new_tokens=64) for _ in range(3500)]
    res = simulate(config(*argv, "--max-running-requests", "4096"), wl)
    assert res.oom == "decode"
    assert simulate(config(*argv, "--max-running-requests", "2048"), wl).oom is None


def test_default_h100_never_ooms_on_its_default_chunk() -> None:
    res = simulate(config(), [RequestSpec(prompt_len=30000, max_new_tokens=8) for _ in range(4)])
    assert res.oom is None and res.finished == 4
