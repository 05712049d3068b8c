"""The fast tier as an object, on plain values: each kind of decision one look can make."""

from __future__ import annotations

from dataclasses import replace

from proxy.control.fast_decision import BudgetReading, FastTier, LoadReading
from proxy.control.fast_tier import Pace, PaceInput, PaceSettings, kv_peak, next_pace
from proxy.engines.base import Sample

S = PaceSettings()
BAND = {"lo": 4, "hi": 64, "headroom": 4}
QUIET = LoadReading(
    in_flight=108,
    batch_in_flight=0,
    backlog=0,
    interactive_waiting=0,
    mean_output_tokens=None,
    ttft_s=None,
    interactive_output_tokens=None,
    step_s=None,
)


def _tier(settings: PaceSettings = S) -> FastTier:
    return FastTier(settings, applies_above=lambda budget: budget + 1, **BAND)


def _sample(t: float, **kw: object) -> Sample:
    base: dict[str, object] = {"queue": 8, "running": 100, "token_usage": 0.7, "retractions_total": 0.0}
    base.update(kw)
    return Sample(time=t, **base)  # type: ignore[arg-type]


def test_retractions_set_a_limit_and_say_why():
    tier = _tier()
    assert tier.decide("w0", _sample(0.0), QUIET).limit is None
    backed = tier.decide("w0", _sample(1.0, retractions_total=3.0), QUIET)
    assert backed.limit == int(108 * S.backoff) and "retractions" in backed.reason
    assert tier.backed_off_at("w0") == 1.0 and tier.backed_off_at("w1") == -float("inf")
    assert _tier().decide("w1", _sample(1.0, retractions_total=3.0), QUIET).limit is None  # per worker


def test_long_answers_raise_the_queue_target_and_interactive_work_steps_the_batch_back():
    long = _tier().decide("w0", _sample(0.0), replace(QUIET, mean_output_tokens=2000.0))
    assert (long.queue_target, long.batch_queue_target) == (64, None)
    beside = _tier().decide("w0", _sample(0.0), replace(QUIET, interactive_waiting=3, batch_in_flight=4, step_s=0.03))
    assert beside.batch_queue_target == S.batch_queue_beside_interactive
    assert beside.first_token_wait_s == S.first_token_steps * 0.03


def test_open_requests_past_the_pool_size_the_batch_and_take_its_newest_back():
    batch, chat = ((100, 30),) * 100, ((200, 100),) * 5
    load = replace(QUIET, in_flight=150, batch_in_flight=100, backlog=40, interactive_waiting=5, step_s=0.03,
                   open_batch=batch, open_interactive=chat)  # fmt: skip
    sample = _sample(0.0, token_usage=0.6, max_total_tokens=10_000)
    decision = _tier().decide("w0", sample, load)
    assert decision.kv_peak_share == (kv_peak(batch) + 5 * 300) / 10_000 == 1.45
    look = PaceInput(time=0.0, running=100, queue=8, token_usage=0.6, retractions_total=0.0, in_flight=150,
                     backlog=40, interactive_waiting=5, step_s=0.03, kv_peak_share=1.45,
                     batch_request_share=130 / 10_000, batch_in_flight=100)  # fmt: skip
    pace = next_pace(Pace(), look, settings=S, **BAND)
    assert (decision.batch_limit, decision.take_back_batch) == (pace.batch_limit, pace.take_back_batch)
    assert decision.take_back_batch > 0
    unsized = _tier().decide("w0", replace(sample, max_total_tokens=None), load)
    assert unsized.kv_peak_share is None and unsized.take_back_batch == 0


def _cohort(written: list[int], **kw: object) -> BudgetReading:
    base: dict[str, object] = {"interactive": False, "asked": 4096, "current": None, "reached": 0, "ended_within": 0}
    base.update(kw)
    return BudgetReading(written=tuple(written), **base)  # type: ignore[arg-type]


def test_enough_answers_set_an_output_budget_and_the_journal_hears_of_it():
    decision = _tier().decide("w0", _sample(0.0), replace(QUIET, budgets=(_cohort([300] * S.budget_min_answers),)))
    (move,) = decision.budgets
    assert (move.interactive, move.asked, move.overrun) == (False, 4096, False)
    assert move.tokens is not None and move.tokens >= 300 and move.tokens % S.budget_step == 0
    (note,) = decision.evidence
    assert (note.budget_tokens, note.previous_tokens, note.applies_above_tokens) == (move.tokens, None, move.tokens + 1)


def test_too_few_answers_leave_a_budget_standing_without_a_journal_line():
    decision = _tier().decide("w0", _sample(0.0), replace(QUIET, budgets=(_cohort([300] * 3, current=512),)))
    assert [m.tokens for m in decision.budgets] == [512] and decision.evidence == ()
    off = _tier(replace(S, output_budget=False))
    lifted = off.decide("w0", _sample(0.0), replace(QUIET, budgets=(_cohort([300] * 3, current=512),)))
    assert [m.tokens for m in lifted.budgets] == [None] and len(lifted.evidence) == 1  # off: it goes


def test_answers_reaching_a_budget_lift_it_as_overrun():
    reading = _cohort([300] * S.budget_min_answers, current=512, reached=S.budget_overrun_answers, ended_within=0)
    decision = _tier().decide("w0", _sample(0.0), replace(QUIET, budgets=(reading,)))
    (move,) = decision.budgets
    assert move.overrun and move.tokens is None
    (note,) = decision.evidence
    assert (note.reached, note.ended_within, note.budget_tokens) == (S.budget_overrun_answers, 0, None)
    few = replace(reading, reached=1, ended_within=40)
    assert not _tier().decide("w0", _sample(0.0), replace(QUIET, budgets=(few,))).budgets[0].overrun


def test_a_worker_is_held_at_what_the_planner_says_under_a_limit_of_its_own():
    held = _tier().decide("w0", _sample(0.0), replace(QUIET, held_open=160))
    assert held.limit == 160 and "CUDA graphs" in held.reason
    assert _tier().decide("w0", _sample(0.0), QUIET).limit is None  # no hold: no limit
    # a limit of its own under the hold stands
    backed = _tier()
    backed.decide("w0", _sample(0.0), replace(QUIET, held_open=160))
    own = backed.decide("w0", _sample(1.0, retractions_total=3.0), replace(QUIET, in_flight=100, held_open=160))
    assert own.limit is not None and own.limit < 160 and "retractions" in own.reason
