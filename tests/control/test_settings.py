"""The [control] table of a policy: its few keys, the ranges by engine argument, the removed keys
refused with what replaced them, and every shipped policy within eight keys."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from proxy.control.constants import CONSTANTS
from proxy.control.rules import RuleSettings
from proxy.engines.base import KnobName
from proxy.engines.sglang.knobs import KNOBS as SGLANG_KNOBS
from proxy.engines.vllm.knobs import KNOBS as VLLM_KNOBS
from proxy.policy import ControlMode, ControlSettings, PolicyError, parse_policy
from proxy.policy_retired import RETIRED_KEYS

POLICIES = sorted((Path(__file__).parents[2] / "policies").glob("*.toml"))


def test_defaults_act_with_the_controllers_own_ranges() -> None:
    c = parse_policy({}).control
    assert c.mode is ControlMode.AUTO and c.bounds == {} and c.restarts_per_hour == 6
    assert c.revive and c.output_budget and c.journal_path == ".pacer/decisions.jsonl"
    rules = RuleSettings(control=c, knobs=SGLANG_KNOBS)
    assert rules.bounds(KnobName.CONSERVATIVENESS) == (0.1, 2.0)
    assert rules.bounds(KnobName.MEMORY_FRACTION) == (0.5, 0.95)
    assert rules.bounds(KnobName.MAX_RUNNING) == (8, SGLANG_KNOBS[KnobName.MAX_RUNNING].maximum)
    assert rules.bounds(KnobName.PREFILL_CHUNK)[0] == 2048


def test_bounds_by_the_engines_argument_name() -> None:
    c = parse_policy(
        {"control": {"bounds": {"schedule_conservativeness": [0.3, 1.6], "max_running_requests": [32]}}}
    ).control
    assert c.bound("schedule_conservativeness") == (0.3, 1.6)
    assert c.bound("max_running_requests") == (32.0, math.inf)
    rules = RuleSettings(control=c, knobs=SGLANG_KNOBS)
    assert rules.bounds(KnobName.CONSERVATIVENESS) == (0.3, 1.6)
    assert rules.bounds(KnobName.MAX_RUNNING)[0] == 32.0
    assert rules.bounds(KnobName.MEMORY_FRACTION) == (0.5, 0.95)  # not named: the controller's own
    vllm = parse_policy(
        {"engine": {"kind": "vllm", "args": {"model": "m"}}, "control": {"bounds": {"max_num_seqs": [16, 256]}}}
    )
    assert RuleSettings(control=vllm.control, knobs=VLLM_KNOBS).bounds(KnobName.MAX_RUNNING) == (16.0, 256.0)


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        pytest.param(
            {"bounds": {"max_num_seqs": [8]}},
            "control.bounds.max_num_seqs",
            "schedule_conservativeness",
            id="another-engines-name",
        ),
        pytest.param(
            {"bounds": {"schedule_conservativeness": [2, 1]}},
            "control.bounds.schedule_conservativeness",
            "low <= high",
            id="bounds-reversed",
        ),
        pytest.param(
            {"bounds": {"mem_fraction_static": [0.5, 0.9, 1]}},
            "control.bounds.mem_fraction_static",
            "[low, high]",
            id="three-numbers",
        ),
        pytest.param({"revive": 1}, "control.revive", "true or false", id="revive-not-bool"),
        pytest.param({"restarts_per_hour": -1}, "control.restarts_per_hour", ">= 0", id="negative-budget"),
        pytest.param({"cooldown": 5}, "control.cooldown", "unknown key", id="unknown-key"),
    ],
)
def test_bad_values_name_the_key(table: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"control": table})
    assert info.value.key == key and words in info.value.problem


@pytest.mark.parametrize("name", [k.split(".", 1)[1] for k in RETIRED_KEYS if k.startswith("control.")])
def test_a_removed_key_is_refused_with_what_replaced_it(name: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"control": {name: 1}})
    assert info.value.key == f"control.{name}"
    assert info.value.problem == f"this key was removed: {RETIRED_KEYS['control.' + name]}"


def test_a_pools_own_table_refuses_a_removed_key_too() -> None:
    pool = {"name": "a", "kind": "sim", "args": {"sim_time_scale": 10}, "control": {"window_s": 6}}
    with pytest.raises(PolicyError) as info:
        parse_policy({"pool": [pool]})
    assert info.value.key == "pool[a].control.window_s" and "engine's seconds" in info.value.problem


def test_every_removed_key_is_a_constant_or_named_in_the_retired_list() -> None:
    kept = {f.name for f in dataclasses.fields(ControlSettings)}
    assert len(kept) <= 8
    assert not kept & {k.split(".", 1)[1] for k in RETIRED_KEYS}
    for k in ("window_s", "cooldown_s", "plan_interval_s", "crash_backoff_s", "retractions_per_min"):
        assert hasattr(CONSTANTS, k) and f"control.{k}" in RETIRED_KEYS


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
def test_check_policy_on_a_shipped_policy_lists_at_most_eight_control_keys(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "check-policy", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    listed = {line.split("=")[0].strip().split(".")[-1] for line in done.stdout.splitlines() if "control." in line}
    written = tomllib.loads(path.read_text()).get("control", {})
    assert len(listed) <= 8 and len(written) <= 8, (listed, written)
    assert set(written) <= {f.name for f in dataclasses.fields(ControlSettings)}
    assert written.get("mode", "auto") == "auto"  # the controller runs in every shipped policy
