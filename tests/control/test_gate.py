"""Restraint: cool-down, the restart budget and the flip guard hold decisions back; safety passes."""

from __future__ import annotations

from dataclasses import replace

from proxy.control.constants import CONSTANTS
from proxy.control.decision import ControlState, Decision, KnobChange, RuleKind
from proxy.control.rules import SAFETY_NET_SERVING, RuleSettings, evaluate, gate
from proxy.engines.base import EventKind, LogEvent
from proxy.engines.sglang.knobs import KNOBS
from proxy.policy import ControlSettings

from .recorded import window_of

C = CONSTANTS  # cool-down 60 s, flip guard 1800 s
SETTINGS = RuleSettings(control=ControlSettings(), knobs=KNOBS)  # 6 restarts/h
ARGS = {"model_path": "m", "schedule_conservativeness": 1.0}


def decision(rule: str, kind: RuleKind, direction: int, new: float, t: float, old: float = 1.0) -> Decision:
    return Decision(
        worker_id="w0",
        rule=rule,
        reason="test",
        time=t,
        old_args={**ARGS, "schedule_conservativeness": old},
        new_args={**ARGS, "schedule_conservativeness": new},
        kind=kind,
        change=KnobChange(
            knob="conservativeness", arg="schedule_conservativeness", old=old, new=new, direction=direction
        ),
    )


def test_cool_down_after_a_restart() -> None:
    st = ControlState.initial("w0", ARGS).after_restart(
        decision("a", RuleKind.TUNING, -1, 0.7, 0.0), 1000.0, C.flip_guard_s
    )
    d = decision("b", RuleKind.TUNING, -1, 0.4, 1050.0, old=0.7)
    why = gate(d, st, SETTINGS, 1030.0)
    assert why is not None and why.startswith("cool-down") and "30.0 s left" in why
    assert gate(d, st, SETTINGS, 1000.0 + C.cooldown_s + 1) is None


def test_cool_down_holds_a_tuning_rule_back() -> None:
    """A start-up line with more free memory than the band's top asks for a larger KV pool (a tuning
    move): within the cool-down of a restart it is refused, and says why."""
    st = replace(ControlState.initial("w0", {**ARGS, "mem_fraction_static": 0.8}), last_restart=-30.0,
                 restarts=(-30.0,))  # fmt: skip
    line = LogEvent(kind=EventKind.STARTUP, time=0.0, fields={"available_gpu_mem_gb": 20.0, "max_total_tokens": 100})
    ev = evaluate(window_of([line]), st, SETTINGS, SAFETY_NET_SERVING)
    assert ev.decision is None
    assert [(d.rule, why.split(":")[0]) for d, why in ev.refused] == [("memory_headroom", "cool-down")]


def test_restart_budget() -> None:
    st = replace(
        ControlState.initial("w0", ARGS), restarts=tuple(float(t) for t in range(0, 3000, 500))
    )  # 6 in the hour
    why = gate(decision("a", RuleKind.CORRECTIVE, +1, 1.3, 3000.0), st, SETTINGS, 3000.0)
    assert why is not None and why.startswith("restart budget spent: 6 restarts")
    assert (
        gate(decision("a", RuleKind.CORRECTIVE, +1, 1.3, 3700.0), st, SETTINGS, 3700.0) is None
    )  # the oldest aged out


def test_safety_ignores_cool_down_and_budget() -> None:
    st = replace(ControlState.initial("w0", ARGS), last_restart=99.0, restarts=tuple(float(t) for t in range(94, 100)))
    assert gate(decision("prefill_oom", RuleKind.SAFETY, -1, 0.5, 100.0), st, SETTINGS, 100.0) is None


def test_tuning_never_flips_a_knob_back() -> None:
    st = ControlState.initial("w0", ARGS).after_restart(
        decision("canary_revert", RuleKind.CORRECTIVE, +1, 1.3, 0.0), 0.0, C.flip_guard_s
    )
    back = decision("planner", RuleKind.TUNING, -1, 1.0, 500.0, old=1.3)
    why = gate(back, st, SETTINGS, 500.0)
    assert why is not None and why.startswith("flip guard: conservativeness was raised by canary_revert")
    assert gate(back, st, SETTINGS, C.flip_guard_s + 1) is None  # long after, it may


def test_corrective_may_reverse_once_then_the_way_back_is_shut() -> None:
    st = ControlState.initial("w0", ARGS).after_restart(
        decision("planner", RuleKind.TUNING, -1, 0.7, 0.0), 0.0, C.flip_guard_s
    )
    up = decision("canary_revert", RuleKind.CORRECTIVE, +1, 1.0, 300.0, old=0.7)
    assert gate(up, st, SETTINGS, 300.0) is None  # a correction after lowering: going back is allowed
    st = st.after_restart(up, 300.0, C.flip_guard_s)
    down = decision("planner", RuleKind.TUNING, -1, 0.7, 600.0)
    why = gate(down, st, SETTINGS, 600.0)
    assert why is not None and why.startswith("flip guard: conservativeness was moved back")
    # the same direction as the correction stays open
    assert gate(decision("canary_revert", RuleKind.CORRECTIVE, +1, 1.3, 600.0), st, SETTINGS, 600.0) is None


def test_safety_revert_holds_every_moved_knob() -> None:
    st = ControlState.initial("w0", ARGS).after_restart(
        decision("planner", RuleKind.TUNING, -1, 0.7, 0.0), 0.0, C.flip_guard_s
    )
    revert = Decision(
        worker_id="w0", rule="crash_loop", reason="r", time=200.0, old_args=st.args, new_args=ARGS, kind=RuleKind.SAFETY
    )
    st = st.after_restart(revert, 200.0, C.flip_guard_s)
    assert dict(st.args) == ARGS
    why = gate(decision("planner", RuleKind.TUNING, -1, 0.7, 1000.0), st, SETTINGS, 1000.0)
    assert why is not None and why.startswith("flip guard")


def test_state_bookkeeping() -> None:
    st = ControlState.initial("w0", ARGS).with_resolved({"max_running_requests": 4096})
    st = st.after_restart(decision("a", RuleKind.TUNING, -1, 0.7, 10.0), 10.0, C.flip_guard_s)
    assert st.last_restart == 10.0 and st.restarts_within(20.0) == 1 and st.without_resolved().resolved == {}
    assert st.args["schedule_conservativeness"] == 0.7 and st.initial_args["schedule_conservativeness"] == 1.0
    st = st.after_death(30.0).after_death(40.0)
    assert st.deaths_within(45.0, 600.0) == 2 and st.deaths_within(45.0, 10.0) == 1
    assert st.mark_good().last_good_args == st.args
