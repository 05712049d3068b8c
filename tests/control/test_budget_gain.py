"""The predicted gain of an output budget: the planner's twin replays a worker's recorded requests as
they were sent and with the budget; the check that measures it gives its gain, judged against the
prediction."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from proxy.control.budget_gain import BudgetInputs, BudgetPrediction, Cohort, predict_budget
from proxy.control.budget_outcome import PendingBudget, Side, check_outcome, judged
from proxy.control.evidence import OutputBudget
from proxy.control.planner import DecodeStats, InFlight, Observed, Twin
from proxy.control.saturation import Pace
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate

GPU, MODEL = "a100-40gb", "llama-3.1-8b"
ARGS = {"model_path": "m", "schedule_conservativeness": 1.0, "sim_gpu": GPU, "sim_model": MODEL}


def _recorded(asked: int = 4096) -> BudgetInputs:
    """A backlog of short answers to requests asking for ``asked`` tokens, served by the simulator at
    SGLang's defaults and recorded as the proxy sees it: the answers in by the look, the rest open."""
    rng = random.Random(7)
    sent = [Observed(arrived=i * 0.01, prompt_tokens=rng.randint(200, 600), output_tokens=rng.randint(100, 400),
                     max_tokens=asked) for i in range(600)]  # fmt: skip
    cfg = Twin(GPU, MODEL).config(ARGS)
    specs = [RequestSpec(arrival=o.arrived, prompt_len=o.prompt_tokens, max_new_tokens=o.max_tokens,
                         output_len=o.output_tokens) for o in sent]  # fmt: skip
    res = simulate(cfg, specs)
    served = [replace(o, finished=r.finish_time) for o, r in zip(sent, res.requests, strict=True)]
    now = sorted(o.finished or 0.0 for o in served)[400]
    decode = tuple(DecodeStats(running=r, used_tokens=u, gen_throughput=g, cuda_graph=c, at=at)
                   for at, r, u, g, c in res.decode_stats if at <= now)  # fmt: skip
    return BudgetInputs(
        gpu=GPU, model=MODEL, args=ARGS, decode=decode, kv_capacity_tokens=cfg.max_total_num_tokens,
        workload=tuple(o for o in served if (o.finished or 0.0) <= now),
        in_flight=tuple(InFlight(arrived=o.arrived, prompt_tokens=o.prompt_tokens, max_tokens=asked)
                        for o in served if (o.finished or 0.0) > now),
        now=now, cohort=Cohort(True, asked), before=asked, budget=asked,
    )  # fmt: skip


def _predicted(inputs: BudgetInputs) -> BudgetPrediction:
    p = predict_budget(inputs)
    assert isinstance(p, BudgetPrediction), p
    return p


def test_a_budget_well_above_the_answers_is_predicted_to_gain_and_a_useless_one_not() -> None:
    recorded = _recorded()
    above = _predicted(replace(recorded, budget=640))  # every answer (100-400) fits under it
    assert above.ratio is not None and above.ratio > 1.1, above
    assert above.requests == 300 and above.cohort == 300  # the planner's sample: the newest plan_requests
    assert above.twin_error is not None and above.twin_error < 0.15  # calibrated on the worker's own lines
    assert above.budget_tok_per_s == pytest.approx(above.ratio * (above.before_tok_per_s or 0.0))
    near = _predicted(replace(recorded, budget=4000))  # hardly less than they ask: the same admission
    assert near.ratio == pytest.approx(1.0, abs=0.02), near
    # below every answer: each reaches it and goes on, the twin's same answer sent as asked
    below = _predicted(replace(recorded, budget=64))
    assert below.ratio == pytest.approx(1.0, abs=1e-9), below
    # a budget moved up from one the answers fit under gains nothing either
    assert _predicted(replace(recorded, before=640, budget=768)).ratio == pytest.approx(1.0, abs=0.02)


def test_the_twin_says_when_it_has_too_little_to_replay() -> None:
    recorded = _recorded()
    assert predict_budget(replace(recorded, workload=())) == "no answered request to replay"
    other = predict_budget(replace(recorded, cohort=Cohort(False, 4096), budget=640))  # the batch class sent none
    assert other == "none of the 300 newest answers is the batch class's asking for max_tokens 4096"


def test_only_the_class_asking_for_the_budgets_max_tokens_is_sent_with_it() -> None:
    cohort = Cohort(True, 4096)
    one = Observed(arrived=0.0, prompt_tokens=10, output_tokens=300, max_tokens=4096)
    assert cohort.sent(one, 640).max_tokens == 640
    assert cohort.sent(replace(one, output_tokens=700), 640).max_tokens == 4096  # reaches it: as asked
    assert cohort.sent(replace(one, interactive=False), 640).max_tokens == 4096  # the other class
    assert cohort.sent(replace(one, max_tokens=2000), 640).max_tokens == 2000  # asked for other
    # one sent under an earlier budget: known by what it asked
    assert cohort.sent(replace(one, max_tokens=512, asked_max_tokens=4096), 640).max_tokens == 640
    # one open on the worker: its length not known, sent with it
    open_ = InFlight(arrived=0.0, prompt_tokens=10, max_tokens=4096)
    assert cohort.open(open_, 640, typical=300).max_tokens == 640
    assert cohort.open(open_, 640, typical=700).max_tokens == 4096  # its answer would reach it


def test_what_the_requests_went_with_before_and_go_with_now() -> None:
    set_ = OutputBudget(request_class="interactive", max_tokens=4096, budget_tokens=640, applies_above_tokens=854,
                        previous_tokens=None, answers=78, high_tokens=399, quantile=0.99, margin=1.5)  # fmt: skip
    assert (set_.sent_before, set_.sent_now) == (4096, 640)
    moved = replace(set_, previous_tokens=640, previous_applies_above_tokens=854, budget_tokens=1024,
                    applies_above_tokens=1366)  # fmt: skip
    assert (moved.sent_before, moved.sent_now) == (640, 1024)
    too_close = replace(set_, budget_tokens=3584, applies_above_tokens=4779)  # applies to none of them
    assert too_close.sent_now == 4096


def test_a_check_gives_the_gain_with_the_first_tokens_and_is_judged_against_the_prediction() -> None:
    # the budget decided at 60 s; with it from 70 s (its batch turned over) at 1500 tokens/s over 20 s of
    # saturated time; held back at 90 s, turned over at 100 s, 1000 tokens/s over 20 s
    before = {"throughput": 900.0}
    pending = PendingBudget.opened(1, Cohort(True, 4096), 60.0, before, 0.5, 30.0, (4096, 640))
    done = replace(pending, with_budget=Side(60.0, 70.0, Pace(20.0, 30_000.0, 30.0)),
                   held_back=Side(90.0, 100.0, Pace(20.0, 20_000.0, 30.0)))  # fmt: skip
    assert done.done(20.0) and not replace(done, held_back=Side(90.0)).done(20.0)
    outcome, fields = check_outcome(done, 0.25)
    assert fields["measured_gain"] == pytest.approx(0.5)
    assert fields["measured_throughput"] == pytest.approx(1500.0)
    assert (fields["first_token_before_s"], fields["first_token_after_s"]) == (0.5, 0.25)
    assert outcome["verdict"] == "better" and outcome["before"] == before
    assert outcome["with_budget"] == {"sent_max_tokens": 640, "turned_over_after_s": 10.0, "saturated_s": 20.0,
                                      "saturated_throughput": 1500.0}  # fmt: skip
    held = outcome["held_back"]
    assert held["sent_max_tokens"] == 4096 and held["turned_over_after_s"] == 10.0
    assert held["saturated_throughput"] == 1000.0
    # met within the twin's error (or the planner's noise floor where that is smaller), else not
    assert judged({"predicted_gain": 0.45, "measured_gain": 0.5, "twin_error": 0.05}, 0.03)["met_prediction"]
    assert not judged({"predicted_gain": 0.2, "measured_gain": 0.5, "twin_error": 0.05}, 0.03)["met_prediction"]
    assert judged({"predicted_gain": 0.2}, 0.03) == {}  # not measured yet
