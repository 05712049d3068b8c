"""The [control] table of a policy: defaults, bounds, and errors that name the key."""

from __future__ import annotations

import pytest

from proxy.policy import ControlMode, PolicyError, parse_policy


def test_defaults_follow_the_tuning_guide() -> None:
    c = parse_policy({}).control
    assert c.mode is ControlMode.OFF
    assert c.low_usage == 0.9 and c.conservativeness_bounds == (0.1, 2.0)
    assert c.retractions_per_1k_tokens == 0.5 and c.retractions_per_min == 6.0 and c.admission_min_gain == 0.15
    assert c.available_mem_band_gb == (5.0, 10.0) and c.memory_fraction_step == 0.01
    assert c.prefill_chunk_min == 2048


def test_overrides() -> None:
    c = parse_policy(
        {"control": {"mode": "advise", "window_s": 30, "cooldown_s": 0, "crash_backoff_s": [0, 1]}}
    ).control
    assert c.mode is ControlMode.ADVISE and c.window_s == 30.0 and c.cooldown_s == 0.0
    assert c.crash_backoff_s == (0.0, 1.0)
    c = parse_policy({"control": {"retractions_per_1k_tokens": 0.25, "admission_min_gain": 0.3}}).control
    assert c.retractions_per_1k_tokens == 0.25 and c.admission_min_gain == 0.3


@pytest.mark.parametrize(
    ("table", "key"),
    [
        pytest.param({"window_s": 10, "min_evidence_s": 20}, "control.min_evidence_s", id="evidence-past-window"),
        pytest.param({"low_usage": 1.5}, "control.low_usage", id="fraction-above-one"),
        pytest.param({"conservativeness_bounds": [2, 1]}, "control.conservativeness_bounds", id="bounds-reversed"),
        pytest.param({"memory_fraction_bounds": [0.5, 1.2]}, "control.memory_fraction_bounds", id="fraction-bound"),
        pytest.param({"crash_backoff_s": []}, "control.crash_backoff_s", id="empty-backoff"),
        pytest.param({"revive": 1}, "control.revive", id="revive-not-bool"),
        pytest.param(
            {"retractions_per_1k_tokens": 0}, "control.retractions_per_1k_tokens", id="relative-threshold-zero"
        ),
        pytest.param({"admission_min_gain": -0.1}, "control.admission_min_gain", id="negative-gain"),
        pytest.param({"restarts_per_hour": -1}, "control.restarts_per_hour", id="negative-budget"),
        pytest.param({"cooldown": 5}, "control.cooldown", id="unknown-key"),
    ],
)
def test_bad_values_name_the_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"control": table})
    assert info.value.key == key
