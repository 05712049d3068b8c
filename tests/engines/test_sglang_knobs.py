"""SGLang's knob table: real flag names, sane ladders, and the stepping helpers of Knob."""

from __future__ import annotations

from proxy.engines.base import KnobName
from proxy.engines.sglang.argv import KNOWN_FLAGS, check_arg
from proxy.engines.sglang.knobs import KNOBS, knobs, resolved_from_server_info


def test_every_neutral_knob_maps_to_a_known_sglang_flag() -> None:
    rules_use = {KnobName.CONSERVATIVENESS, KnobName.PREFILL_CHUNK, KnobName.MAX_RUNNING, KnobName.MEMORY_FRACTION}
    assert rules_use <= set(knobs())
    for knob in KNOBS.values():
        assert knob.arg in KNOWN_FLAGS, knob.arg
        if knob.choices:  # a knob of names: each one a value the flag takes
            assert all(check_arg(knob.arg, choice) is None for choice in knob.choices), knob.arg
            continue
        sample = knob.default if knob.default is not None else (knob.ladder[-1] if knob.ladder else knob.minimum)
        value = int(sample) if knob.integer else float(sample)
        assert check_arg(knob.arg, value) is None, (knob.arg, value)


def test_prefill_chunk_ladder_follows_the_guide() -> None:
    chunk = KNOBS[KnobName.PREFILL_CHUNK]
    assert chunk.rung_below(8192, floor=2048) == 4096
    assert chunk.rung_below(4096, floor=2048) == 2048
    assert chunk.rung_below(2048, floor=2048) is None  # at the policy's floor
    assert chunk.rung_below(6000, floor=2048) == 4096  # off-ladder values step to the rung below
    assert chunk.rung_below(-1, floor=2048) == 16384  # chunking disabled -> the top rung


def test_clamp() -> None:
    running = KNOBS[KnobName.MAX_RUNNING]
    assert running.clamp(0.4) == 1 and isinstance(running.clamp(12.7), int)
    assert KNOBS[KnobName.MEMORY_FRACTION].clamp(0.8300000001) == 0.83
    assert KNOBS[KnobName.CONSERVATIVENESS].clamp(-1.0) == 0.0


def test_resolved_from_server_info() -> None:
    info = {"mem_fraction_static": 0.83, "chunked_prefill_size": 8192, "max_running_requests": None, "model_path": "m"}
    assert resolved_from_server_info(info) == {"mem_fraction_static": 0.83, "chunked_prefill_size": 8192}
