"""The vLLM knob table: every knob names a flag the argv builder knows, within its checks."""

from __future__ import annotations

import pytest

from proxy.engines.base import KnobName
from proxy.engines.registry import ENGINES
from proxy.engines.vllm.argv import KNOWN_FLAGS, check_arg
from proxy.engines.vllm.knobs import KNOBS, consistent, fitting_max_model_len


def test_registry_finds_the_table() -> None:
    table = ENGINES["vllm"].knobs
    assert {k: v.arg for k, v in table.items()} == {
        KnobName.MAX_RUNNING: "max_num_seqs",
        KnobName.PREFILL_CHUNK: "max_num_batched_tokens",
        KnobName.MEMORY_FRACTION: "gpu_memory_utilization",
        KnobName.MAX_CONTEXT: "max_model_len",
        KnobName.GRAPH_MAX_BS: "max_cudagraph_capture_size",
    }
    assert KnobName.CONSERVATIVENESS not in table  # vLLM has no such argument


@pytest.mark.parametrize("knob", list(KNOBS.values()), ids=lambda k: str(k.name))
def test_bounds_are_valid_flag_values(knob) -> None:
    assert knob.arg in KNOWN_FLAGS
    for value in (knob.minimum, knob.maximum, *knob.ladder):
        assert check_arg(knob.arg, knob.clamp(value)) is None


def test_fitting_max_model_len() -> None:
    assert fitting_max_model_len(1920) == 1920
    assert fitting_max_model_len(77808) == 77808
    assert fitting_max_model_len(1000) == 992
    assert fitting_max_model_len(20) == 16
    assert fitting_max_model_len(10) == 16  # never below the knob's minimum


def test_consistent_keeps_batched_tokens_at_least_max_num_seqs() -> None:
    assert consistent({"max_num_seqs": 512, "max_num_batched_tokens": 256})["max_num_batched_tokens"] == 512
    assert consistent({"max_num_seqs": 24, "max_num_batched_tokens": 2048})["max_num_batched_tokens"] == 2048
    assert consistent({"max_num_seqs": 24}) == {"max_num_seqs": 24}
