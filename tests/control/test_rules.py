"""Every rule on recorded sample series and log excerpts: when it fires, and when it must not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.control.decision import Action, ControlState, Decision, KnobChange, RuleKind
from proxy.control.evidence import ConservativenessStorm, Retractions
from proxy.control.rules import (
    ON_DEATH,
    WHILE_SERVING,
    RuleSettings,
    admission_too_conservative,
    crash_loop,
    crash_loop_unbroken,
    decode_oom,
    evaluate,
    memory_headroom,
    memory_low,
    oom_unknown_phase,
    pacing_too_timid,
    prefill_oom,
    retraction_storm,
    revive_delay,
)
from proxy.control.window import Window
from proxy.engines.base import EventKind, LogEvent
from proxy.engines.sglang.knobs import KNOBS
from proxy.policy import ControlSettings

from .recorded import ENGINE_FIXTURES, log_events, samples, window_of

SETTINGS = RuleSettings(control=ControlSettings(), knobs=KNOBS)
# The recorded storm fixtures retract 0.21 (samples) and 0.11 (log) requests per 1k output tokens:
# storms for a deployment whose threshold is 0.1 per 1k; the default (0.5) is tested on its own below.
STORM = RuleSettings(control=ControlSettings(retractions_per_1k_tokens=0.1), knobs=KNOBS)
ARGS = {"model_path": "m", "schedule_conservativeness": 1.0}


def state(args: dict[str, object] | None = None, **kw: object) -> ControlState:
    return replace(ControlState.initial("w0", ARGS if args is None else args), **kw)  # type: ignore[arg-type]


# -- admission too conservative ------------------------------------------------------------------


def test_low_usage_with_queue_lowers_conservativeness() -> None:
    d = admission_too_conservative(window_of(samples("samples_conservative.json")), state(), SETTINGS)
    assert d is not None and d.rule == "admission_too_conservative" and d.kind is RuleKind.TUNING
    # usage 0.64 with requests waiting: 1.0 x (0.64 / 0.36) / (0.9 / 0.1) = 0.2, in one restart
    assert d.changes == {"schedule_conservativeness": (1.0, 0.2)}
    assert d.evidence_json()["low_usage_fraction"] == 1.0 and d.direction == -1
    assert d.evidence_json()["mean_usage_waiting"] == pytest.approx(0.64, abs=0.005)
    assert "token usage 0.64 (< 0.9)" in d.reason


@pytest.mark.parametrize(
    ("window", "args"),
    [
        pytest.param(
            window_of(samples("samples_conservative.json", until=15)), ARGS, id="hysteresis-too-little-evidence"
        ),
        pytest.param(window_of(samples("samples_healthy.json")), ARGS, id="healthy-usage"),
        pytest.param(window_of(samples("samples_idle.json")), ARGS, id="empty-queue"),
        pytest.param(
            window_of(samples("samples_capped.json")), {**ARGS, "max_running_requests": 64}, id="batch-at-its-cap"
        ),
        pytest.param(
            window_of(samples("samples_conservative.json")),
            {**ARGS, "schedule_conservativeness": 0.1},
            id="at-lower-bound",
        ),
        pytest.param(
            window_of(
                samples("samples_conservative.json"),
                [LogEvent(kind=EventKind.RETRACTION, time=30.0, fields={"retracted": 1})],
            ),
            ARGS,
            id="a-retraction-in-window",
        ),
    ],
)
def test_admission_rule_must_not_fire(window: Window, args: dict[str, object]) -> None:
    assert admission_too_conservative(window, state(args), SETTINGS) is None


def test_admission_rule_waits_while_the_pool_is_still_filling() -> None:
    from proxy.engines.base import Sample

    # long prompts after a start-up: usage climbs 0.10 -> 0.85 over the window with requests waiting
    filling = [
        Sample(time=float(t), queue=130, running=min(90, 3 * t), token_usage=0.10 + 0.0125 * t) for t in range(61)
    ]
    assert window_of(filling).conservative_fraction(0.9) == 1.0
    assert admission_too_conservative(window_of(filling), state(), SETTINGS) is None
    # the same usage once it has levelled off is evidence
    level = [Sample(time=float(t), queue=130, running=90, token_usage=0.60 + 0.01 * (t % 3)) for t in range(61)]
    d = admission_too_conservative(window_of(level), state(), SETTINGS)
    assert d is not None and d.changes == {"schedule_conservativeness": (1.0, 0.17)}  # usage 0.61


def test_admission_rule_default_conservativeness_when_unset() -> None:
    d = admission_too_conservative(
        window_of(samples("samples_conservative.json")), state({"model_path": "m"}), SETTINGS
    )
    assert (
        d is not None
        and d.changes == {"schedule_conservativeness": (None, 0.2)}
        and d.evidence_json()["old_value"] == 1.0
    )


@pytest.mark.parametrize(
    ("current", "lower_bound", "expected"),
    [
        pytest.param(2.0, 0.1, 0.39, id="sized-by-usage-from-far-above"),  # 2.0 x (0.64 / 0.36) / 9
        pytest.param(0.5, 0.1, 0.1, id="sized-by-usage-not-below-the-bound"),  # 0.099 -> the bound
        pytest.param(0.3, 0.1, 0.1, id="down-to-the-bound"),
        pytest.param(1.0, 0.5, 0.5, id="the-bound-wins"),
    ],
)
def test_admission_rule_sizes_its_step_by_the_usage(current: float, lower_bound: float, expected: float) -> None:
    settings = RuleSettings(control=ControlSettings(conservativeness_bounds=(lower_bound, 2.0)), knobs=KNOBS)
    d = admission_too_conservative(
        window_of(samples("samples_conservative.json")), state({**ARGS, "schedule_conservativeness": current}), settings
    )
    assert d is not None and d.new_args["schedule_conservativeness"] == pytest.approx(expected)


def _waiting_at(usage: float) -> Window:
    from proxy.engines.base import Sample

    return window_of(
        [Sample(time=float(t), queue=130, running=300, token_usage=usage + 0.01 * (t % 2)) for t in range(61)]
    )


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param(0.63, 0.19, id="early-stop-like-usage-0.63"),
        pytest.param(0.75, 0.34, id="usage-0.75"),
        pytest.param(0.50, 0.11, id="half-full"),
    ],
)
def test_admission_step_follows_how_far_usage_is_below_the_line(usage: float, expected: float) -> None:
    d = admission_too_conservative(_waiting_at(usage), state(), SETTINGS)
    assert d is not None and d.new_args["schedule_conservativeness"] == pytest.approx(expected, abs=0.01)
    assert d.evidence_json()["possible_gain"] >= SETTINGS.control.admission_min_gain


@pytest.mark.parametrize("usage", [0.85, 0.8])
def test_admission_rule_must_not_fire_when_the_batch_could_grow_only_a_little(usage: float) -> None:
    """Usage 0.85 with requests waiting (low-mem-fraction after its memory move, outputs 33-67 % of
    max_tokens): the batch could grow by 6 %, less than a restart costs, and a lower ratio retracts."""
    assert admission_too_conservative(_waiting_at(usage), state(), SETTINGS) is None
    loose = RuleSettings(control=ControlSettings(admission_min_gain=0.01), knobs=KNOBS)
    assert admission_too_conservative(_waiting_at(usage), state(), loose) is not None  # the key decides


# -- retraction storm --------------------------------------------------------------------------


def test_retraction_counter_storm_raises_conservativeness() -> None:
    w = window_of(samples("samples_retraction_storm.json"))
    d = retraction_storm(w, state(), STORM)
    assert d is not None and d.kind is RuleKind.CORRECTIVE and d.direction == +1
    assert d.changes == {"schedule_conservativeness": (1.0, 1.3)}
    assert d.evidence_json()["retraction_rate_per_min"] > 6


def _raised(
    rate_before: float, throughput_before: float | None, *, at: float = 0.0, rule: str = "retraction_storm"
) -> ControlState:
    """The state after a raise 0.7 -> 1.0 at ``at`` made on that retraction rate and throughput."""
    figures = Retractions(retraction_rate_per_min=rate_before, threshold_per_min=6.0, retractions_per_1k_tokens=None,
                          threshold_per_1k_tokens=0.1, retractions=100, observed_s=60.0)  # fmt: skip
    raise_ = Decision(
        worker_id="w0", rule=rule, reason="r", time=at, kind=RuleKind.CORRECTIVE,
        change=KnobChange(knob="conservativeness", arg="schedule_conservativeness", old=0.7, new=1.0, direction=+1),
        evidence=ConservativenessStorm(storm=figures, throughput=throughput_before),
        old_args={**ARGS, "schedule_conservativeness": 0.7}, new_args=ARGS,
    )  # fmt: skip
    return replace(
        state({**ARGS, "schedule_conservativeness": 0.7}).after_restart(raise_, at, STORM.control.flip_guard_s),
        last_restart=None,
    )


def test_retraction_rule_records_throughput_for_the_next_look() -> None:
    w = window_of(samples("samples_retraction_storm.json"))
    d = retraction_storm(w, state(), STORM)
    assert d is not None and d.evidence_json()["throughput"] == pytest.approx(w.throughput, abs=0.1)


def test_retraction_rule_raises_again_when_the_last_raise_paid() -> None:
    w = window_of(samples("samples_retraction_storm.json"))
    rate, tp = w.retraction_rate_per_min, w.throughput
    assert rate > 6 and tp is not None
    for st in (
        _raised(rate * 3, tp * 0.9),  # the last raise cut retractions to a third and throughput rose
        _raised(rate * 3, None),  # ... no throughput figure then
        _raised(rate, tp * 2, rule="memory_low"),  # the last move of the knob was not this rule's
        _raised(rate, tp * 2, at=w.now - STORM.control.flip_guard_s - 1),  # that raise is long past
    ):
        d = retraction_storm(w, st, STORM)
        assert d is not None and d.changes == {"schedule_conservativeness": (1.0, 1.3)}


@pytest.mark.parametrize(
    ("rate_factor", "throughput_factor"),
    [
        pytest.param(1.0, 0.5, id="the-last-raise-did-not-cut-retractions"),
        pytest.param(1.5, 0.5, id="the-last-raise-cut-them-by-a-third-only"),
        pytest.param(3.0, 1.2, id="the-last-raise-cut-them-but-throughput-fell"),
    ],
)
def test_retraction_rule_must_not_raise_again_when_the_last_raise_did_not_pay(
    rate_factor: float, throughput_factor: float
) -> None:
    w = window_of(samples("samples_retraction_storm.json"))
    assert w.throughput is not None
    st = _raised(w.retraction_rate_per_min * rate_factor, w.throughput * throughput_factor)
    assert retraction_storm(w, st, STORM) is None


def test_retraction_log_storm_raises_conservativeness() -> None:
    w = window_of(log_events("log_retraction_storm.log"))
    d = retraction_storm(w, state({"schedule_conservativeness": 1.9}), STORM)
    assert d is not None and d.changes == {"schedule_conservativeness": (1.9, 2.0)}  # bounded


def _busy_with_retractions(per_min: float, tokens_per_s: float) -> Window:
    """61 s of a busy server: ``per_min`` retractions a minute at ``tokens_per_s`` output tokens/s."""
    from proxy.engines.base import Sample

    return window_of([
        Sample(time=float(t), queue=130, running=150, token_usage=0.95, retractions_total=per_min * t / 60.0,
               generation_tokens_total=tokens_per_s * t)
        for t in range(61)
    ])  # fmt: skip


def test_retraction_rule_is_relative_to_the_work_done() -> None:
    """retraction-storm in the paced replay: at conservativeness 0.1 the first minute retracts about
    1.0 request per 1k output tokens (then the reset ratio stalls admission for minutes): a storm. At
    SGLang's default 1.0 the same workload retracts in bursts of up to 0.47 per 1k a minute as its
    ratio decays and resets (the oracle's own arguments do the same, and 1.9 did not stop them): no
    storm, whatever the absolute rate (the old threshold, 6 a minute, fired on it)."""
    storm = retraction_storm(_busy_with_retractions(60.0, 1000.0), state({"schedule_conservativeness": 0.1}), SETTINGS)
    assert storm is not None and storm.changes == {"schedule_conservativeness": (0.1, 0.4)}
    assert storm.evidence_json()["retractions_per_1k_tokens"] == pytest.approx(1.0, abs=0.01)
    assert storm.evidence_json()["threshold_per_1k_tokens"] == 0.5
    assert (
        retraction_storm(_busy_with_retractions(57.0, 2260.0), state(), SETTINGS) is None
    )  # a burst at 1.0: 0.42 per 1k
    # the same count of retractions on a server five times slower is a storm
    assert retraction_storm(_busy_with_retractions(57.0, 452.0), state(), SETTINGS) is not None
    # and a deployment may call less a storm
    assert retraction_storm(_busy_with_retractions(57.0, 2260.0), state(), STORM) is not None


def test_retraction_rule_keeps_its_noise_floor() -> None:
    """A handful of retractions on a slow server is a large share of little work, but under the floor."""
    assert retraction_storm(_busy_with_retractions(5.0, 50.0), state(), SETTINGS) is None
    tighter = RuleSettings(control=ControlSettings(retractions_per_min=1.0), knobs=KNOBS)
    assert retraction_storm(_busy_with_retractions(5.0, 50.0), state(), tighter) is not None


@pytest.mark.parametrize(
    ("window", "conservativeness"),
    [
        pytest.param(window_of(samples("samples_healthy.json")), 1.0, id="one-retraction-is-fine"),
        pytest.param(window_of(samples("samples_retraction_storm.json", until=12)), 1.0, id="hysteresis"),
        pytest.param(window_of(samples("samples_retraction_storm.json")), 2.0, id="at-upper-bound"),
        pytest.param(window_of(samples("samples_retraction_storm.json")), 3.0, id="above-bound-never-lowers"),
    ],
)
def test_retraction_rule_must_not_fire(window: Window, conservativeness: float) -> None:
    assert retraction_storm(window, state({"schedule_conservativeness": conservativeness}), SETTINGS) is None


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
    wide = RuleSettings(
        control=ControlSettings(available_mem_band_gb=(5.0, 13.0), memory_fraction_step=0.01), knobs=KNOBS
    )
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), wide)  # the middle (9 GB): 0.83 + 4.5 / 79.4
    assert d is not None and d.new_args["mem_fraction_static"] == pytest.approx(0.887)
    big_step = RuleSettings(control=ControlSettings(memory_fraction_step=0.1), knobs=KNOBS)
    d = memory_headroom(w, state({"mem_fraction_static": 0.83}), big_step)
    assert d is not None and d.new_args["mem_fraction_static"] == pytest.approx(0.93)  # the step is the floor
    capped = RuleSettings(control=ControlSettings(memory_fraction_bounds=(0.5, 0.88)), knobs=KNOBS)
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
    assert d.delay_s == ControlSettings().crash_backoff_s[2]


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
    d = crash_loop_unbroken(same, SETTINGS.control, 35.0, NO_MODULE)
    assert d is not None and d.rule == "crash_loop" and d.action is Action.NOTE and dict(d.new_args) == ARGS
    assert d.evidence.to_json() == {"deaths": 3, "window_s": 600.0, "fallback": "policy", "last_death": NO_MODULE}
    assert d.reason.startswith(f"crash loop: 3 deaths in 600 s, the last: {NO_MODULE}; it runs the policy's arguments")
    good = state({**ARGS, "schedule_conservativeness": 0.7}, deaths=(10.0, 20.0, 30.0))
    on_good = crash_loop_unbroken(replace(good, last_good_args=good.args), SETTINGS.control, 35.0, "x")
    assert on_good is not None and "it runs the last arguments that ran well" in on_good.reason
    assert on_good.evidence.to_json()["fallback"] == "last_good"


def test_a_crash_loop_note_must_not_be_written() -> None:
    assert crash_loop_unbroken(state(deaths=(10.0, 20.0)), SETTINGS.control, 35.0, "x") is None  # no loop
    assert crash_loop_unbroken(state(deaths=(10.0, 20.0, 30.0)), SETTINGS.control, 1000.0, "x") is None  # past
    noted = state(deaths=(10.0, 20.0, 30.0), crash_loop_noted=True)
    assert crash_loop_unbroken(noted, SETTINGS.control, 35.0, "x") is None  # this loop was noted
    other = state({**ARGS, "schedule_conservativeness": 0.7}, initial_args=ARGS, deaths=(10.0, 20.0, 30.0))
    assert crash_loop(Window(now=35.0), other, SETTINGS) is not None
    assert crash_loop_unbroken(other, SETTINGS.control, 35.0, "x") is None  # crash_loop goes back to the policy's


def test_revive_delay_grows() -> None:
    c = ControlSettings()
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
    w = window_of(samples("samples_retraction_storm.json"), log_events("log_startup_headroom.log"))
    ev = evaluate(w, state({**ARGS, "mem_fraction_static": 0.8}), STORM, WHILE_SERVING)
    assert ev.decision is not None and ev.decision.rule == "retraction_storm" and ev.refused == ()


def test_evaluate_healthy_fires_nothing() -> None:
    ev = evaluate(window_of(samples("samples_healthy.json")), state(), SETTINGS)
    assert ev.decision is None and ev.refused == ()


def test_admission_rule_must_not_restart_at_the_end_of_a_batch() -> None:
    """low-mem-fraction, paced replay: usage dips to 0.74 in the last minute, as the batch runs out.
    Less waits in the proxy than is on the worker: a restart would take back the running work and pay
    a start-up for what is left. With a backlog it fires as before."""
    w = window_of(samples("samples_conservative.json"))
    last = w.samples[-1]
    on_worker = last.running + last.queue
    assert admission_too_conservative(w.push_proxy_queue(w.now, on_worker - 1), state(), SETTINGS) is None
    assert admission_too_conservative(w.push_proxy_queue(w.now, 0), state(), SETTINGS) is None
    d = admission_too_conservative(w.push_proxy_queue(w.now, 5000), state(), SETTINGS)
    assert d is not None and d.evidence_json()["proxy_backlog"] == 5000
    assert admission_too_conservative(w, state(), SETTINGS) is not None  # no backlog figure: the rule as before
