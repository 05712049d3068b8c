"""The engine-neutral rules with vLLM's knob table: preemptions cap ``max_num_seqs`` (the planner's
twin models SGLang only, so on vLLM this tuning stays a rule); a start-up
refusal over KV capacity lowers ``max_model_len`` to what vLLM says fits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from proxy.control.decision import ControlState, RuleKind
from proxy.control.rules import ON_DEATH, RuleSettings, evaluate, kv_capacity, retraction_storm
from proxy.control.window import Window
from proxy.engines.base import EventKind, LogEvent, Sample
from proxy.engines.sglang.knobs import KNOBS as SGLANG_KNOBS
from proxy.engines.vllm.knobs import KNOBS
from proxy.engines.vllm.logs import parse_line
from proxy.policy import ControlSettings

FIXTURES = Path(__file__).parent.parent / "engines" / "fixtures"
SETTINGS = RuleSettings(control=ControlSettings(), knobs=KNOBS)
ARGS = {"model": "m", "max_num_seqs": 128, "num_gpu_blocks_override": 64}


def preempting(seconds: int = 40) -> list[Sample]:
    """A full KV cache holding 20-28 running requests, 10 preemptions a second."""
    return [
        Sample(time=float(t), queue=150, running=20 + t % 9, token_usage=0.98, retractions_total=10.0 * t,
               generation_tokens_total=5000.0 * t)
        for t in range(seconds)
    ]  # fmt: skip


def test_preemptions_cap_max_num_seqs_at_what_the_full_cache_holds() -> None:
    window = Window().push_all(preempting())
    d = retraction_storm(window, ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.rule == "retraction_storm" and d.kind is RuleKind.CORRECTIVE
    assert d.changes == {"max_num_seqs": (128, 19)}  # the median of 20..28, x 0.8
    assert d.evidence_json()["running_when_kv_full"] == 24 and d.evidence_json()["retraction_rate_per_min"] == 600.0
    assert "lower max_num_seqs 128 -> 19" in d.reason


def with_lengths(
    samples: list[Sample], capacity: int, tokens_per_request: float, finished_per_s: float = 2.0
) -> list[Sample]:
    """``samples`` with a KV capacity and requests of ``tokens_per_request`` (prompt + output) finishing."""
    return [
        replace(smp, max_total_tokens=capacity, finished_requests_total=finished_per_s * smp.time,
                finished_request_tokens_total=tokens_per_request * finished_per_s * smp.time)
        for smp in samples
    ]  # fmt: skip


def test_preemptions_cap_max_num_seqs_at_the_whole_requests_that_fit() -> None:
    # 8,192 KV tokens, requests of 108 + 256 tokens: 22 fit whole, while about 24 ran when it was full
    window = Window().push_all(with_lengths(preempting(), 8192, 364.0))
    d = retraction_storm(window, ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.changes == {"max_num_seqs": (128, 22)}
    assert d.evidence_json()["requests_that_fit"] == 22 and d.evidence_json()["kv_capacity_tokens"] == 8192
    assert d.evidence_json()["mean_request_tokens"] == 364.0 and d.evidence_json()["running_when_kv_full"] == 24
    assert "22 whole requests of 364 tokens fit its 8192 tokens: lower max_num_seqs 128 -> 22" in d.reason


def test_whole_request_fit_is_read_across_a_counter_reset() -> None:
    samples = with_lengths(preempting(), 8192, 364.0)
    # the engine restarted at t=20: its counters start again from zero
    samples = samples[:20] + [replace(smp, finished_requests_total=smp.finished_requests_total - 40.0,
                                      finished_request_tokens_total=smp.finished_request_tokens_total - 40 * 364.0)
                              for smp in samples[20:]]  # fmt: skip
    d = retraction_storm(Window().push_all(samples), ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.evidence_json()["requests_that_fit"] == 22


def test_short_requests_fall_back_below_the_running_count() -> None:
    # 8,192 / 200 = 40 whole requests fit, more than ran: the preemptions come from longer ones
    window = Window().push_all(with_lengths(preempting(), 8192, 200.0))
    d = retraction_storm(window, ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.changes == {"max_num_seqs": (128, 19)} and "requests_that_fit" not in d.evidence_json()


def test_no_finished_request_falls_back_below_the_running_count() -> None:
    samples = [
        replace(smp, finished_requests_total=0.0, finished_request_tokens_total=0.0)
        for smp in with_lengths(preempting(), 8192, 364.0)
    ]
    d = retraction_storm(Window().push_all(samples), ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.changes == {"max_num_seqs": (128, 19)}


def test_whole_request_fit_is_clamped_to_the_policy_floor() -> None:
    window = Window().push_all(with_lengths(preempting(), 1024, 364.0))  # 2 fit
    d = retraction_storm(window, ControlState.initial("w0", ARGS), SETTINGS)
    assert d is not None and d.changes == {"max_num_seqs": (128, 8)}  # the controller's floor for the running cap
    floor = RuleSettings(control=ControlSettings(bounds={"max_num_seqs": (12.0,)}), knobs=KNOBS)
    d = retraction_storm(window, ControlState.initial("w0", ARGS), floor)
    assert d is not None and d.changes == {"max_num_seqs": (128, 12)}  # the policy's bounds


def test_no_move_when_the_cap_is_already_below_what_fits() -> None:
    window = Window().push_all(preempting())
    assert retraction_storm(window, ControlState.initial("w0", {**ARGS, "max_num_seqs": 16}), SETTINGS) is None


def test_on_sglang_the_storm_is_the_planners() -> None:
    """The planner's twin models SGLang's admission: there no rule restarts for a storm."""
    window = Window().push_all(preempting())
    d = retraction_storm(
        window,
        ControlState.initial("w0", {"schedule_conservativeness": 1.0}),
        RuleSettings(control=ControlSettings(), knobs=SGLANG_KNOBS),
    )
    assert d is None


def _log_window(name: str) -> Window:
    lines = (FIXTURES / name).read_text().splitlines()
    events = [e for e in (parse_line(line, float(i) / 10) for i, line in enumerate(lines)) if e is not None]
    return Window().push_all(events)


def test_recorded_refusal_lowers_max_model_len_to_what_fits() -> None:
    window = _log_window("vllm_0.32_cpu_kv_capacity_error.log")
    state = ControlState.initial("w0", {"model": "m", "max_model_len": 4096, "kv_cache_memory_bytes": 1 << 20})
    d = evaluate(window, state, SETTINGS, ON_DEATH).decision
    assert d is not None and d.rule == "kv_capacity" and d.kind is RuleKind.SAFETY
    assert d.changes == {"max_model_len": (4096, 1920)}
    assert d.evidence_json()["estimated_max_context"] == 1920 and "max seq len (4096)" in str(d.evidence_json()["log"])


def test_refusal_without_a_length_raises_the_memory_fraction() -> None:
    line = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    window = Window().push(parse_line(line, 1.0))  # type: ignore[arg-type]
    d = kv_capacity(window, ControlState.initial("w0", {"model": "m"}), SETTINGS)
    assert d is not None and d.changes == {"gpu_memory_utilization": (None, 0.93)}  # unset: vLLM's 0.92, one step up


def test_a_warning_that_does_not_stop_the_engine_is_ignored() -> None:
    event = LogEvent(
        kind=EventKind.KV_CAPACITY_ERROR, time=1.0, fields={"kv_tokens": 1000, "context_len": 4096, "fatal": False}
    )
    assert kv_capacity(Window().push(event), ControlState.initial("w0", {}), SETTINGS) is None


def test_prefill_oom_halves_max_num_batched_tokens() -> None:
    from proxy.engines.vllm.logs import LogFollower

    head = "(EngineCore_DP0 pid=7) ERROR 01-01 00:00:00 [core.py:1510] "
    lines = [head + "Traceback (most recent call last):",
             head + '  File "/v/vllm/v1/worker/gpu_model_runner.py", line 4420, in _dummy_run',
             head + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB."]  # fmt: skip
    follower = LogFollower()
    window = Window().push_all([e for i, line in enumerate(lines) for e in follower.feed(line, float(i))])
    state = ControlState.initial("w0", {"model": "m", "max_num_batched_tokens": 8192})
    d = evaluate(window, state, SETTINGS, ON_DEATH).decision
    assert d is not None and d.rule == "prefill_oom"
    assert d.changes == {"max_num_batched_tokens": (8192, 4096)}
