"""Options a person must choose: suggested with their reason, journalled as notes, never applied."""

from __future__ import annotations

from dataclasses import replace

from proxy.console.decisions import format_decision
from proxy.control.constants import CONSTANTS
from proxy.control.controller import Controller
from proxy.control.journal import Journal
from proxy.control.suggestions import Facts, suggest
from proxy.engines.base import Choice, Sample
from proxy.engines.registry import ENGINES
from proxy.engines.sglang.engine import SIM
from proxy.policy import ControlSettings
from tests.control.test_controller import Around, Clock, RecordingActor, SGLangLogs, feed, info

SGLANG, VLLM = ENGINES["sglang"], ENGINES["vllm"]
SMALL = Facts(peak_running=12, waiting_usage=0.4, model="llama-3.2-1b", model_params=1.24e9, weights_share=0.03)
FULL = Facts(peak_running=300, waiting_usage=0.96, model="llama-3.1-70b", model_params=70.6e9, weights_share=0.85)


def _options(facts: Facts, args: dict[str, object], engine: object = SGLANG, prices: bool = True) -> dict[str, str]:
    found = suggest(facts, args, engine.choice_args, engine.knobs, twin_prices_levers=prices)  # type: ignore[attr-defined]
    return {str(s.option): s.evidence.suggested_args for s in found}


def test_small_batches_on_a_small_model_suggest_torch_compile_unless_it_is_on() -> None:
    found = suggest(SMALL, {}, SGLANG.choice_args, SGLANG.knobs, twin_prices_levers=True)
    assert [(s.option, dict(s.args)) for s in found] == [(Choice.TORCH_COMPILE, {"enable_torch_compile": True})]
    assert "small batches (at most 12 running) and a small model (llama-3.2-1b)" in found[0].reason
    assert _options(SMALL, {"enable_torch_compile": True}) == {}
    # large batches, or a large model: no
    assert _options(FULL, {}).keys() == {"fp8_kv_cache", "fp8_weights"}


def test_a_full_pool_suggests_fp8_kv_and_with_heavy_weights_fp8_weights_in_each_engines_words() -> None:
    assert _options(FULL, {}) == {"fp8_kv_cache": "kv_cache_dtype=fp8_e4m3", "fp8_weights": "quantization=fp8"}
    assert _options(FULL, {}, VLLM, prices=False) == {
        "fp8_kv_cache": "kv_cache_dtype=fp8",
        "fp8_weights": "quantization=fp8",
    }
    light = replace(FULL, weights_share=0.2)
    assert _options(light, {}) == {"fp8_kv_cache": "kv_cache_dtype=fp8_e4m3"}
    assert _options(FULL, {"kv_cache_dtype": "fp8_e5m2", "quantization": "awq"}) == {}
    # vLLM compiles by default: never a torch.compile suggestion there
    assert "torch_compile" not in _options(SMALL, {}, VLLM, prices=False)


def test_vllm_levers_the_twin_cannot_price_are_suggested() -> None:
    past = Facts(peak_running=700, waiting_usage=0.5, model="llama-3.1-8b", model_params=8e9, weights_share=0.2)
    assert _options(past, {}, VLLM, prices=False) == {"graph_max_bs": "max_cudagraph_capture_size=768"}
    assert _options(past, {"max_cudagraph_capture_size": 1024}, VLLM, prices=False) == {}
    off = _options(SMALL, {"enable_chunked_prefill": False}, VLLM, prices=False)
    assert off == {"prefill_chunk": "enable_chunked_prefill=True"}
    # on SGLang the planner's twin prices the graphs: no suggestion for them
    assert "graph_max_bs" not in _options(past, {}, SGLANG, prices=True)


def test_the_controller_journals_a_suggestion_once_as_a_note_and_changes_nothing() -> None:
    clock = Clock()
    c = Controller(ControlSettings(), SIM.knobs, Journal(None, wall_clock=lambda: 1_800_000_000.0),
                   engine=SGLangLogs(), surroundings=Around(), actor=RecordingActor(), clock=clock,
                   hold=lambda worker_id: None, modelled=lambda args: SIM.modelled(args, ()), constants=CONSTANTS,
                   choice_args=SIM.choice_args)  # fmt: skip
    c.track(info())
    rows = [Sample(time=float(t), queue=2, running=10, token_usage=0.3) for t in range(0, 90)]
    feed(c, clock, rows)
    assert c.tick() == []
    clock.now += 5.0
    assert c.tick() == []
    entries = [e for e in c.journal.entries() if e["rule"] == "suggestion"]
    assert len(entries) == 1 and entries[0]["status"] == "noted" and entries[0]["action"] == "note"
    evidence = entries[0]["evidence"]
    assert evidence["option"] == "torch_compile" and evidence["suggested_args"] == "enable_torch_compile=True"
    assert evidence["peak_running"] == 10 and evidence["model"] == "llama-3.1-8b"
    assert not entries[0]["changes"] and entries[0]["new_args"] == entries[0]["old_args"]
    line = format_decision(entries[0])
    assert "suggestion [noted]" in line and "suggest enable_torch_compile=True: small batches" in line
