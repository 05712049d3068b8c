"""Every rule on recorded sample series and log excerpts: when it fires, and when it must not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.control.constants import CONSTANTS
from proxy.control.decision import Action, ControlState, RuleKind
from proxy.control.rules import (
    ON_DEATH,
    SAFETY_NET_SERVING,
    RuleSettings,
    crash_loop,
    crash_loop_unbroken,
    decode_oom,
    evaluate,
    memory_headroom,
    memory_low,
    oom_unknown_phase,
    pacing_too_timid,
    prefill_oom,
    revive_delay,
)
from proxy.control.window import Window
from proxy.engines.base import EventKind, LogEvent
from proxy.engines.sglang.knobs import KNOBS
from proxy.policy import ControlSettings

from .recorded import ENGINE_FIXTURES, log_events, samples, window_of

SETTINGS = RuleSettings(control=ControlSettings(), knobs=KNOBS)
ARGS = {"model_path": "m", "schedule_conservativeness": 1.0}


def state(args: dict[str, object] | None = None, **kw: object) -> ControlState:
    return replace(ControlState.initial("w0", ARGS if args is None else args), **kw)  # type: ignore[arg-type]


# -- start-up memory ------------------------------------------------------------------------------


def test_memory_headroom_raises_fraction_by_small_steps() -> None:
    w = window_of(log_events("log_startup_headroom.log"))
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), SETTINGS)
    # 13.5 GB free with 0.83 static: the GPU holds >= 13.5 / 0.17 = 79.4 GB; 6 GB more to the pool
    # leaves the band's middle (7.5 GB) free: 0.83 + 6 / 79.4 = 0.906, one restart instead of eight
    assert (
        d is not None
        and d.changes == {"mem_fraction_static": (0.83, 0.906)}
        and d.evidence_json()["available_gpu_mem_gb"] == 13.5
    )
    assert d.evidence_json()["gpu_total_gb_at_least"] == 79.4
    assert memory_low(w, state({"mem_fraction_static": 0.83}), SETTINGS) is None


def test_memory_rules_need_a_known_fraction_and_respect_bounds() -> None:
    w = window_of(log_events("log_startup_headroom.log"))
    assert memory_headroom(w, state({}), SETTINGS) is None  # unset and not resolved
    assert memory_headroom(w, state({"mem_fraction_static": 0.95}), SETTINGS) is None  # at the policy's bound
    resolved = state({}).with_resolved({"mem_fraction_static": 0.8})
    d = memory_headroom(w, resolved, SETTINGS)
    assert d is not None and d.new_args["mem_fraction_static"] == 0.889  # 0.8 + 6 / (13.5 / 0.2)


def test_memory_headroom_steps_at_least_the_policy_step_and_stays_in_bounds() -> None:
    w = window_of(log_events("log_startup_headroom.log"))  # 13.5 GB free
    wide = RuleSettings(control=ControlSettings(), knobs=KNOBS,
                        constants=replace(CONSTANTS, available_mem_band_gb=(5.0, 13.0)))  # fmt: skip
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), wide)  # the middle (9 GB): 0.83 + 4.5 / 79.4
    assert d is not None and d.new_args["mem_fraction_static"] == pytest.approx(0.887)
    big_step = RuleSettings(
        control=ControlSettings(), knobs=KNOBS, constants=replace(CONSTANTS, memory_fraction_step=0.1)
    )
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), big_step)
    assert d is not None and d.new_args["mem_fraction_static"] == pytest.approx(0.93)  # the step is the floor
    capped = RuleSettings(control=ControlSettings(bounds={"mem_fraction_static": (0.5, 0.88)}), knobs=KNOBS)
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), capped)
    assert d is not None and d.new_args["mem_fraction_static"] == 0.88


def test_memory_low_lowers_fraction() -> None:
    w = window_of(log_events("log_startup_tight.log"))
    d = memory_low(w, state({"mem_fraction_static": 0.9}), SETTINGS)
    assert d is not None and d.changes == {"mem_fraction_static": (0.9, 0.89)} and d.kind is RuleKind.CORRECTIVE
    assert memory_headroom(w, state({"mem_fraction_static": 0.9}), SETTINGS) is None


def test_memory_in_band_fires_nothing() -> None:
    w = window_of(log_events("log_retraction_storm.log"))  # 7.10 GB free at start-up
    assert memory_low(w, state({"mem_fraction_static": 0.9}), SETTINGS) is None
    assert memory_headroom(w, state({"mem_fraction_static": 0.9}), SETTINGS) is None


# -- out of memory --------------------------------------------------------------------------------


def test_prefill_oom_walks_down_the_chunk_ladder() -> None:
    w = window_of(log_events(ENGINE_FIXTURES / "sglang_crash_prefill_cuda_oom.log"))
    d = prefill_oom(w, state({"chunked_prefill_size": 8192}), SETTINGS)
    assert d is not None and d.kind is RuleKind.SAFETY and d.changes == {"chunked_prefill_size": (8192, 4096)}
    d = prefill_oom(w, state({"chunked_prefill_size": 4096}), SETTINGS)
    assert d is not None and d.changes == {"chunked_prefill_size": (4096, 2048)}


def test_prefill_oom_reads_the_resolved_chunk_from_the_startup_line() -> None:
    w = window_of(
        log_events("log_startup_headroom.log"),
        log_events(ENGINE_FIXTURES / "sglang_crash_prefill_allocator.log", offset=30),
    )
    d = prefill_oom(w, state({}), SETTINGS)
    assert (
        d is not None and d.changes == {"chunked_prefill_size": (None, 4096)} and d.evidence_json()["old_value"] == 8192
    )


def test_prefill_oom_at_the_floor_lowers_memory_instead() -> None:
    w = window_of(log_events(ENGINE_FIXTURES / "sglang_crash_prefill_cuda_oom.log"))
    d = prefill_oom(w, state({"chunked_prefill_size": 2048, "mem_fraction_static": 0.85}), SETTINGS)
    assert d is not None and d.changes == {"mem_fraction_static": (0.85, 0.84)}
    assert prefill_oom(w, state({"chunked_prefill_size": 2048}), SETTINGS) is None  # nothing left to lower


def test_decode_oom_caps_running_below_peak() -> None:
    w = window_of(log_events(ENGINE_FIXTURES / "sglang_crash_decode_cuda_oom.log"))
    d = decode_oom(w, state({"max_running_requests": 1024}), SETTINGS)
    assert (
        d is not None
        and d.changes == {"max_running_requests": (1024, 409)}
        and d.evidence_json()["peak_running"] == 512
    )
    assert prefill_oom(w, state(), SETTINGS) is None  # a decode OOM is not a prefill OOM


def test_decode_oom_with_the_pool_half_empty_gives_the_activations_pool_memory(tmp_path) -> None:
    """The same death with the KV pool 34 % full at the peak (0.61 GB free at fraction 0.95): the
    batch the pool admits is kept, and a quarter more free memory comes out of the pool. The GPU holds
    at least 0.61 / 0.05 = 12.2 GB, so 0.15 GB more is at most 0.0125 of it: 0.95 -> 0.937."""
    text = (
        (ENGINE_FIXTURES / "sglang_crash_decode_cuda_oom.log")
        .read_text()
        .replace("token usage: 0.92", "token usage: 0.34")
    )
    startup = ("[2026-09-13 16:10:00 TP0] max_total_num_tokens=671062, chunked_prefill_size=4096, max_prefill_tokens=16384, "
               "max_running_requests=2048, context_len=131072, available_gpu_mem=0.61 GB\n")  # fmt: skip
    (tmp_path / "spare.log").write_text(startup + text)
    w = window_of(log_events(tmp_path / "spare.log"), span_s=600.0)
    d = decode_oom(w, state({"max_running_requests": 2048, "mem_fraction_static": 0.95}), SETTINGS)
    assert d is not None and d.kind is RuleKind.SAFETY
    assert d.changes == {"mem_fraction_static": (0.95, 0.937)}  # the running cap stays
    assert d.evidence_json()["peak_token_usage"] == 0.34 and d.evidence_json()["peak_running"] == 512
    # a pool at the spare mark or fuller: the cap comes down instead, as above
    full = replace(SETTINGS, constants=replace(CONSTANTS, spare_pool_usage=0.3))
    capped = decode_oom(w, state({"max_running_requests": 2048, "mem_fraction_static": 0.95}), full)
    assert capped is not None and capped.changes == {"max_running_requests": (2048, 409)}


def test_oom_of_unknown_phase_lowers_memory() -> None:
    oom = LogEvent(kind=EventKind.OOM, time=1.0, fields={"phase": "unknown"}, line="torch.OutOfMemoryError")
    w = Window().push(oom)
    d = oom_unknown_phase(w, state({"mem_fraction_static": 0.8}), SETTINGS)
    assert d is not None and d.changes == {"mem_fraction_static": (0.8, 0.79)}
    assert decode_oom(w, state(), SETTINGS) is None and prefill_oom(w, state(), SETTINGS) is None


def test_no_oom_no_oom_rule() -> None:
    w = window_of(samples("samples_retraction_storm.json"))
    assert all(rule(w, state(), SETTINGS) is None for rule in ON_DEATH)


# -- crash loop -----------------------------------------------------------------------------------


def test_crash_loop_goes_back_to_last_good_args() -> None:
    good = {**ARGS, "schedule_conservativeness": 1.3}
    st = state({**ARGS, "schedule_conservativeness": 0.7}, last_good_args=good, deaths=(10.0, 20.0, 30.0))
    d = crash_loop(Window(now=35.0), st, SETTINGS)
    assert d is not None and d.rule == "crash_loop" and dict(d.new_args) == good and d.kind is RuleKind.SAFETY
    assert d.delay_s == CONSTANTS.crash_backoff_s[2]


def test_crash_loop_must_not_fire() -> None:
    two = state({**ARGS, "schedule_conservativeness": 0.7}, deaths=(10.0, 20.0))
    assert crash_loop(Window(now=35.0), two, SETTINGS) is None  # two deaths are no loop
    old = state({**ARGS, "schedule_conservativeness": 0.7}, deaths=(10.0, 20.0, 30.0))
    assert crash_loop(Window(now=1000.0), old, SETTINGS) is None  # deaths out of the 600 s window
    same = state(deaths=(10.0, 20.0, 30.0))
    assert crash_loop(Window(now=35.0), same, SETTINGS) is None  # already on the fallback args


NO_MODULE = "exited with code 1: python3: Error while finding module specification for 'sglang.launch_server'"


def test_a_crash_loop_on_the_fallback_args_is_a_note_with_its_deaths_and_last_cause() -> None:
    """What crash_loop leaves alone (nothing to go back to) is noted, not left silent."""
    same = state(deaths=(10.0, 20.0, 30.0))
    d = crash_loop_unbroken(same, SETTINGS.constants, 35.0, NO_MODULE)
    assert d is not None and d.rule == "crash_loop" and d.action is Action.NOTE and dict(d.new_args) == ARGS
    assert d.evidence.to_json() == {"deaths": 3, "window_s": 600.0, "fallback": "policy", "last_death": NO_MODULE}
    assert d.reason.startswith(f"crash loop: 3 deaths in 600 s, the last: {NO_MODULE}; it runs the policy's arguments")
    good = state({**ARGS, "schedule_conservativeness": 0.7}, deaths=(10.0, 20.0, 30.0))
    on_good = crash_loop_unbroken(replace(good, last_good_args=good.args), SETTINGS.constants, 35.0, "x")
    assert on_good is not None and "it runs the last arguments that ran well" in on_good.reason
    assert on_good.evidence.to_json()["fallback"] == "last_good"


def test_a_crash_loop_note_must_not_be_written() -> None:
    assert crash_loop_unbroken(state(deaths=(10.0, 20.0)), SETTINGS.constants, 35.0, "x") is None  # no loop
    assert crash_loop_unbroken(state(deaths=(10.0, 20.0, 30.0)), SETTINGS.constants, 1000.0, "x") is None  # past
    noted = state(deaths=(10.0, 20.0, 30.0), crash_loop_noted=True)
    assert crash_loop_unbroken(noted, SETTINGS.constants, 35.0, "x") is None  # this loop was noted
    other = state({**ARGS, "schedule_conservativeness": 0.7}, initial_args=ARGS, deaths=(10.0, 20.0, 30.0))
    assert crash_loop(Window(now=35.0), other, SETTINGS) is not None
    assert crash_loop_unbroken(other, SETTINGS.constants, 35.0, "x") is None  # crash_loop goes back to the policy's


def test_revive_delay_grows() -> None:
    c = CONSTANTS
    delays = [revive_delay(state(deaths=tuple(float(i) for i in range(n))), c, 10.0) for n in (0, 1, 2, 3, 9)]
    assert delays == [
        c.crash_backoff_s[0],
        c.crash_backoff_s[0],
        c.crash_backoff_s[1],
        c.crash_backoff_s[2],
        c.crash_backoff_s[-1],
    ]


# -- pacing too timid (noted only) ---------------------------------------------------------------


def test_timid_pacing_is_noted() -> None:
    w = window_of(samples("samples_idle.json")).push_proxy_queue(0.0, 500)
    d = pacing_too_timid(w, state(), SETTINGS)
    assert d is not None and d.action is Action.NOTE and d.new_args == d.old_args
    assert pacing_too_timid(window_of(samples("samples_idle.json")), state(), SETTINGS) is None  # proxy held nothing
    assert (
        pacing_too_timid(window_of(samples("samples_conservative.json")).push_proxy_queue(0.0, 500), state(), SETTINGS)
        is None
    )


# -- evaluation order -------------------------------------------------------------------------------


def test_evaluate_while_serving_picks_first_admitted_rule() -> None:
    """A retraction storm beside a start-up line with memory to spare: the rules keep only the safety
    net (the storm is the planner's to price), so the memory band's move is the one taken."""
    w = window_of(samples("samples_retraction_storm.json"), log_events("log_startup_headroom.log"))
    ev = evaluate(w, state({**ARGS, "mem_fraction_static": 0.8}), SETTINGS, SAFETY_NET_SERVING)
    assert ev.decision is not None and ev.decision.rule == "memory_headroom" and ev.refused == ()


@pytest.mark.parametrize("fixture", ["samples_retraction_storm.json", "samples_conservative.json"])
def test_no_rule_tunes_admission_while_serving(fixture: str) -> None:
    """A retraction storm or a pool held back by admission: no rule restarts the worker for it (the
    planner's twin decides whether a restart pays)."""
    ev = evaluate(window_of(samples(fixture)), state(), SETTINGS, SAFETY_NET_SERVING)
    assert ev.decision is None or ev.decision.action is Action.NOTE


def test_evaluate_healthy_fires_nothing() -> None:
    ev = evaluate(window_of(samples("samples_healthy.json")), state(), SETTINGS)
    assert ev.decision is None and ev.refused == ()
