"""KV pool sizing and SGLang's GPU-memory defaults (reference section 3/4)."""

from __future__ import annotations

import pytest

from proxy.sim import memory
from proxy.sim.config import SimConfigError
from proxy.sim.presets import GPUS, MIB, MODELS
from tests.sim.helpers import config

H100 = GPUS["h100-80gb"].memory_mib
LLAMA8B = MODELS["llama-3.1-8b"]


@pytest.mark.parametrize(
    ("gpu", "chunk", "graph_bs"),
    [
        pytest.param("rtx3080-10gb", 2048, 8, id="<20GiB"),
        pytest.param("rtx4090-24gb", 4096, 48, id="<35GiB"),
        pytest.param("a100-40gb", 4096, 32, id="<60GiB"),
        pytest.param("h100-80gb", 8192, 256, id="<90GiB"),
        pytest.param("h200-141gb", 8192, 256, id="<160GiB"),
    ],
)
def test_defaults_by_gpu_memory(gpu: str, chunk: int, graph_bs: int) -> None:
    mib = GPUS[gpu].memory_mib
    assert memory.default_chunked_prefill_size(mib) == chunk
    assert memory.default_cuda_graph_max_bs(mib) == graph_bs


def test_graph_max_bs_capped_by_max_running_requests() -> None:
    assert memory.default_cuda_graph_max_bs(H100, max_running_requests=64) == 64


def test_mem_fraction_static_h100_default() -> None:
    # reserved = 512 + 8192 x 1.5 + 1/8 x 1024 + 2 x 256 = 13440 MiB (above the 10 GiB floor)
    assert memory.default_mem_fraction_static(H100, 8192, 256) == round((H100 - 13440) / H100, 3) == 0.835


def test_mem_fraction_static_floor_on_big_gpus() -> None:
    # reserved = 512 + 2048 x 1.5 + 128 + 512 = 4224 MiB < 10 GiB: the floor applies on a > 60 GiB GPU
    assert memory.default_mem_fraction_static(H100, 2048, 256) == round((H100 - 10240) / H100, 3)
    small = GPUS["rtx3080-10gb"].memory_mib
    assert memory.default_mem_fraction_static(small, 2048, 8) == round((small - (512 + 3072 + 128 + 16)) / small, 3)


def test_pool_is_static_memory_minus_weights_over_kv_bytes() -> None:
    cfg = config()
    assert cfg.mem_fraction_static == 0.835
    assert LLAMA8B.kv_bytes_per_token_bf16 == 32 * 8 * 128 * 2 * 2 == 131072
    expected = int((0.835 * H100 * MIB - 8.03e9 * 2) // 131072)
    assert cfg.max_total_num_tokens == expected
    assert 400_000 < expected < 450_000


def test_max_total_tokens_caps_the_pool_and_frees_memory() -> None:
    full, capped = config(), config("--max-total-tokens", "100000")
    assert capped.max_total_num_tokens == 100_000
    assert capped.memory.available_mib > full.memory.available_mib


def test_available_gpu_mem_tells_the_truth() -> None:
    cfg = config("--mem-fraction-static", "0.9")
    m = cfg.memory
    assert m.available_mib == pytest.approx(m.total_mib - m.weights_mib - m.kv_pool_mib - m.graph_mib - m.context_mib)
    # a higher static fraction leaves less for activations
    assert m.available_mib < config().memory.available_mib


def test_kv_fp8_doubles_the_pool() -> None:
    base, fp8 = config(), config("--kv-cache-dtype", "fp8_e4m3")
    assert fp8.max_total_num_tokens == pytest.approx(2 * base.max_total_num_tokens, abs=2)


def test_default_max_running_requests() -> None:
    assert memory.default_max_running_requests(422_286, 131072) == 2048  # estimate 1649 -> floor 2048
    assert memory.default_max_running_requests(665_690, 65536) == 4096  # the guide's start-up line
    assert memory.default_max_running_requests(1000, 131072) == 500  # token_capacity // 2
    assert memory.default_max_running_requests(422_286, 131072, given=64) == 64


def test_weights_that_do_not_fit_refuse_to_start() -> None:
    with pytest.raises(SimConfigError, match="Not enough memory"):
        config("--sim-gpu", "rtx3080-10gb")


def test_unknown_and_multi_gpu_flags_are_refused() -> None:
    with pytest.raises(SimConfigError, match="1, 2, 4 or 8"):
        config("--tp-size", "3")
    with pytest.raises(SimConfigError, match="--dp-size"):
        config("--dp-size", "2")


def test_a_tensor_parallel_worker_has_a_larger_kv_pool_and_faster_steps() -> None:
    one, four = config("--sim-model", "llama-3.1-8b"), config("--sim-model", "llama-3.1-8b", "--tp-size", "4")
    assert four.tp_size == 4 and four.server_args["tp_size"] == 4
    # the weights are held once across four GPUs: the pool grows by more than 4x
    assert four.max_total_num_tokens > 4 * one.max_total_num_tokens
    for batch in (1, 64):
        assert four.step_model().decode_seconds(batch, 50_000, True) < one.step_model().decode_seconds(
            batch, 50_000, True
        )
    assert four.step_model().prefill_seconds(4096, 4096**2 / 2, 1) < one.step_model().prefill_seconds(
        4096, 4096**2 / 2, 1
    )
