"""An output budget inside the controller: its journal entry gets the twin's predicted gain (computed
off the loop, as plans are) and, once its check is done, the gain measured: the worker's pace with
the budget over its pace with the budget held back, each once its batch turned over; a restart that
pays waits for it. Recorded inputs, a clock the test moves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from proxy.console.decisions import format_decision
from proxy.control.budget_gain import Cohort, predict_budget
from proxy.control.controller import Controller
from proxy.control.evidence import OutputBudget
from proxy.control.planner import InFlight
from proxy.engines.base import Sample
from proxy.policy import ControlMode
from tests.harness.wait import wait_until

from .test_controller import Clock, controller, info
from .test_planner_controller import ARGS, Requests, _backlog_of_short_answers, _serve

A = TypeVar("A")
R = TypeVar("R")

SET = OutputBudget(request_class="interactive", max_tokens=4096, budget_tokens=768, applies_above_tokens=1024,
                   previous_tokens=None, answers=256, high_tokens=499, quantile=0.99, margin=1.5)  # fmt: skip


def _serving(tmp_path: Path, **kw: Any) -> tuple[Controller, Clock, float, float]:
    """A worker that has served a backlog of short answers to requests asking for 4096 tokens (its log
    lines, scrapes and answers), then as fast for as long again (its batch settled:
    tests/control/test_saturation.py): the controller, its clock, the worker's throughput and its
    output counter."""
    requests = _backlog_of_short_answers()
    c, clock = controller(ControlMode.AUTO, tmp_path, around=Requests(requests), **kw)
    c.track(info(args=ARGS))
    rate = _serve(c, clock, requests, 0.0)
    served = clock.now
    left = served * int(rate)  # where ``_serve`` left the counter
    _scrapes(c, clock, served, int(served), rate, left, lambda: None)
    return c, clock, rate, left + int(served) * rate


def _scrapes(
    c: Controller, clock: Clock, start: float, seconds: int, rate: float, total: float, tick: Callable[[], None]
) -> None:
    """The worker at ``rate`` output tokens/s for ``seconds`` from ``start`` (its counter going on from
    ``total``), a tick after each scrape."""
    for k in range(1, seconds + 1):
        clock.now = start + k
        total += rate
        c.on_sample("w0", Sample(time=clock.now, queue=50, running=200, token_usage=0.9,
                                 generation_tokens_total=total))  # fmt: skip
        tick()


def test_a_budget_gets_its_predicted_then_its_measured_gain(tmp_path: Path) -> None:
    c, clock, rate, total = _serving(tmp_path)
    opens = clock.now
    c.on_output_budget("w0", SET, opens)
    (entry,) = c.journal.entries()
    assert entry["rule"] == "output_budget" and entry["outcome"]["before"]["throughput"] == pytest.approx(
        rate, rel=0.01
    )
    assert "predicted_gain" not in entry and "measured_gain" not in entry  # the replay runs off the loop
    (job,) = c.budget_predictions_due()
    assert c.budget_predictions_due() == []  # taken once
    assert job.inputs.cohort == Cohort(True, 4096)
    assert (job.inputs.before, job.inputs.budget) == (4096, 768)
    assert job.inputs.decode and job.inputs.workload  # the planner's: the worker's lines and its answers
    c.record_budget_prediction(job, predict_budget(job.inputs))
    entry = c.journal.get(entry["id"]) or {}
    # the answers (120-500 tokens) fit under it: the engine admits for what they need
    assert entry["predicted_gain"] > 0.1 and entry["predicted_ratio"] == pytest.approx(1 + entry["predicted_gain"])
    assert entry["predicted_throughput"] > entry["predicted_current"] and 0 <= entry["twin_error"] < 0.15
    text = format_decision(entry)
    assert f"predicted {entry['predicted_gain']:+.1%}" in text and "measured -" in text  # not measured yet
    gained = rate * (1 + entry["predicted_gain"])  # with the budget, as predicted
    around = c.surroundings
    assert isinstance(around, Requests)
    switches = [opens]  # the budget's, then its hold's

    def second(k: int) -> float:
        """The worker at ``opens + k``: its requests stay 5 s there, its pace the budget's once all of
        them went with it, until it is held back."""
        clock.now = opens + k
        around.open = [InFlight(arrived=t, prompt_tokens=300, max_tokens=4096, dispatched=t)
                       for t in (clock.now - 4.5, clock.now - 0.5)]  # fmt: skip
        return gained if len(switches) == 1 and clock.now >= opens + 5.0 else rate

    for k in range(1, 200):
        total += second(k)
        c.on_sample("w0", Sample(time=clock.now, queue=50, running=200, token_usage=0.9,
                                 generation_tokens_total=total))  # fmt: skip
        c.tick()
        if around.budgets_held and len(switches) == 1:  # held back: the requests go as they ask
            assert around.budgets_held == {("w0", True, 4096): None}
            switches.append(clock.now)
        if "measured_gain" in (c.journal.get(entry["id"]) or {}):
            break
    entry = c.journal.get(entry["id"]) or {}
    assert around.budgets_held == {}  # the budget applies again
    # each side read from 5 s after its switch (its batch turned over), the budget's 20 s in before the hold
    outcome = entry["outcome"]
    assert outcome["with_budget"]["turned_over_after_s"] == 5.0 and outcome["held_back"]["turned_over_after_s"] == 5.0
    assert switches[1] == opens + 5.0 + c.constants.min_evidence_s and clock.now == switches[1] + 25.0
    assert outcome["with_budget"]["saturated_throughput"] == pytest.approx(gained, rel=0.01)
    assert outcome["held_back"]["saturated_throughput"] == pytest.approx(rate, rel=0.01)
    assert entry["measured_gain"] == pytest.approx(entry["predicted_gain"], abs=0.02)
    assert entry["measured_throughput"] == pytest.approx(gained, rel=0.01) and outcome["verdict"] == "better"
    assert entry["met_prediction"] is True and entry["prediction_tolerance"] >= c.constants.plan_min_gain
    assert entry["first_token_before_s"] is None  # whole answers: the proxy saw no first token
    text = format_decision(entry)
    assert f"predicted {entry['predicted_gain']:+.1%}" in text and f"measured {entry['measured_gain']:+.1%}" in text
    assert "within the twin's error" in text


def test_a_budget_beside_another_class_is_not_held_back_to_measure_it(tmp_path: Path) -> None:
    """A batch request open on the worker beside the chat: the worker's pace is not the chat budget's
    alone, and holding the budget back would make the chat's first tokens wait for room again."""
    c, clock, rate, total = _serving(tmp_path)
    around = c.surroundings
    assert isinstance(around, Requests)
    around.open = [InFlight(arrived=clock.now - 1, prompt_tokens=300, max_tokens=2000, interactive=False)]
    c.on_output_budget("w0", SET, clock.now)
    (entry,) = c.journal.entries()
    assert entry["not_measured"] == "the worker serves another class beside it: its pace is not this budget's alone"
    opens = clock.now
    for k in range(1, 60):
        clock.now = opens + k
        total += rate
        c.on_sample("w0", Sample(time=clock.now, queue=50, running=200, token_usage=0.9,
                                 generation_tokens_total=total))  # fmt: skip
        c.tick()
        assert around.budgets_held == {}  # never held back
    assert "measured_gain" not in (c.journal.get(entry["id"]) or {})


def test_a_budget_moved_before_its_check_is_done_is_not_measured_and_a_twin_without_answers_says_so(
    tmp_path: Path,
) -> None:
    c, clock = controller(ControlMode.AUTO, tmp_path, around=Requests([]))
    c.track(info(args=ARGS))
    c.on_output_budget("w0", SET, 1.0)
    moved = OutputBudget(**{**SET.to_json(), "budget_tokens": 1024, "previous_tokens": 768,  # type: ignore[arg-type]
                            "previous_applies_above_tokens": 1024, "applies_above_tokens": 1366})  # fmt: skip
    clock.now = 2.0
    c.on_output_budget("w0", moved, 2.0)
    first, second = c.journal.entries()
    assert first["not_measured"] == "the budget was moved again (#2) before its check was done"
    jobs = c.budget_predictions_due()
    assert [(j.inputs.before, j.inputs.budget) for j in jobs] == [(4096, 768), (768, 1024)]
    c.record_budget_prediction(jobs[1], predict_budget(jobs[1].inputs))
    entry = c.journal.get(second["id"]) or {}
    assert entry["not_predicted"] == "no answered request to replay" and "predicted_gain" not in entry
    assert "not predicted: no answered request to replay" in format_decision(entry)
    lifted = OutputBudget(**{**moved.to_json(), "budget_tokens": None, "previous_tokens": 1024,  # type: ignore[arg-type]
                             "applies_above_tokens": None})  # fmt: skip
    c.on_output_budget("w0", lifted, 3.0)
    assert c.budget_predictions_due() == []  # a lifted budget is neither predicted nor measured
    assert (c.journal.get(second["id"]) or {})["not_measured"].startswith("the budget was lifted (#3)")


def test_a_restart_that_pays_waits_while_a_budget_is_measured(tmp_path: Path) -> None:
    c, clock, _, _ = _serving(tmp_path)
    c.on_output_budget("w0", SET, clock.now)
    budget_id = c.journal.entries()[-1]["id"]
    for _ in range(c.constants.plan_confirmations):  # plans in a row say a restart pays
        clock.now += c.constants.plan_interval_s
        (job,) = c.plans_due()
        assert c.plan_now(job) is None
    waited = c.journal.entries()[-1]
    assert waited["rule"] == "planner" and waited["status"] == "refused" and waited["predicted_gain"] > 0.03
    assert waited["detail"] == (
        f"output budget #{budget_id} is being measured on this worker: a restart waits until its gain is in"
    )


async def test_the_prediction_runs_off_the_loop_where_plans_run(tmp_path: Path) -> None:
    ran: list[str] = []

    def offload(fn: Callable[[A], R], arg: A, /) -> asyncio.Future[R]:  # the planner's, recording what it runs
        ran.append(fn.__name__)
        return asyncio.ensure_future(asyncio.to_thread(fn, arg))

    c, clock, _, _ = _serving(tmp_path, offload=offload, interval_s=0.01)
    c.on_output_budget("w0", SET, clock.now)
    entry_id = c.journal.entries()[-1]["id"]
    task = asyncio.create_task(c.run())
    try:
        await wait_until(lambda: "predicted_gain" in (c.journal.get(entry_id) or {}), "the prediction journaled",
                         timeout=60)  # fmt: skip
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert "predict_budget" in ran
