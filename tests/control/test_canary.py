"""The canary's verdict: each worker's share of the others' throughput, before its restart and over
its window. Pure figures first, then the controller on hand-built scrapes of four workers (a clock
the test moves): a candidate that caps the running batch is reverted although each of its few
requests decodes faster than the others' (the figure the canary used to judge on), a fixed worker
keeps its fix, a better one is rolled out one worker at a time, and an operator's trial is refused
in words when it cannot start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.control.canary import CanaryVerdict, failing, judge, pays_above, share
from proxy.control.controller import Controller, TrialRefused
from proxy.engines.base import Sample
from proxy.policy import ControlMode
from proxy.workers.base import WorkerState

from .test_controller import ARGS, Clock, RecordingActor, controller, info

WORKERS = ("w0", "w1", "w2", "w3")


def test_share_and_the_verdict() -> None:
    assert share(3000.0, [2000.0, 4000.0, None]) == 1.0
    assert share(None, [1.0]) is None and share(1.0, [None]) is None and share(1.0, [0.0]) is None
    assert judge(None, 1.0, 0.03) is CanaryVerdict.WAIT
    assert judge(1.2, 1.0, 0.03) is CanaryVerdict.PROMOTE  # beats the others, and gained on its own standing
    assert judge(1.02, 1.0, 0.03) is CanaryVerdict.REVERT  # within the margin: not worth a restart
    assert judge(0.4, 1.0, 0.03) is CanaryVerdict.REVERT
    assert judge(1.0, 0.6, 0.03) is CanaryVerdict.KEEP  # a bad start fixed: caught up, nothing to roll out
    assert judge(1.2, 1.19, 0.03) is CanaryVerdict.REVERT  # it always served more (its traffic): no gain
    assert judge(1.2, None, 0.03) is CanaryVerdict.PROMOTE  # not measured before: against equals
    # a planner's canary: rolled out only where a restart of each other worker pays back over the horizon
    assert pays_above(60_000.0, 2_000.0, 600.0) == pytest.approx(1.05)
    assert pays_above(60_000.0, 0.0, 600.0) is None and pays_above(1.0, 2_000.0, 0.0) is None
    assert judge(1.04, 1.0, 0.03, 1.05) is CanaryVerdict.KEEP  # past the margin, short of what pays
    assert judge(1.06, 1.0, 0.03, 1.05) is CanaryVerdict.PROMOTE
    assert judge(1.02, 1.0, 0.03, 1.01) is CanaryVerdict.REVERT  # the margin still stands


def _scrape(c: Controller, clock: Clock, start: float, seconds: int, figures: dict[str, tuple[int, float]]) -> None:
    """A scrape a second of each worker: (running batch, output tokens/s)."""
    base = {wid: 0.0 for wid in figures}
    for k in range(seconds + 1):
        clock.now = start + k
        for wid, (running, tok_per_s) in figures.items():
            c.on_sample(wid, Sample(time=clock.now, queue=20, running=running, token_usage=0.8,
                                    generation_tokens_total=base[wid] + k * tok_per_s))  # fmt: skip


def _fleet(tmp_path: Path) -> tuple[Controller, Clock, RecordingActor]:
    actor = RecordingActor()
    c, clock = controller(ControlMode.AUTO, tmp_path, actor)
    for wid in WORKERS:
        c.track(info(wid, args=ARGS))
    return c, clock, actor


def _trial_then(c: Controller, clock: Clock, actor: RecordingActor, args: dict[str, object],
                before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> int:  # fmt: skip
    _scrape(c, clock, 0.0, 30, before)
    act = c.trial("w1", args)
    assert act.decision.rule == "operator_trial" and act.decision.reason.startswith("operator trial")
    assert c.canary is not None and c.canary.worker_id == "w1"
    asyncio.run(c.carry_out(act))
    assert actor.calls[-1] == ("restart", "w1", {**ARGS, **args})
    _scrape(c, clock, clock.now, int(c.constants.window_s) + 1, after)
    return act.entry_id


def test_a_capped_candidate_is_reverted_though_each_of_its_requests_decodes_faster(tmp_path: Path) -> None:
    c, clock, actor = _fleet(tmp_path)
    even = dict.fromkeys(WORKERS, (100, 3000.0))
    # capped to 4 running requests: 600 tok/s, 150 per running request against the others' 30
    capped = {**even, "w1": (4, 600.0)}
    assert 600.0 / 4 > 3000.0 / 100  # per running request the candidate looks five times better
    entry_id = _trial_then(c, clock, actor, {"max_running_requests": 4}, even, capped)
    (revert,) = c.tick()
    assert revert.decision.rule == "canary_revert" and revert.decision.worker_id == "w1"
    assert revert.decision.new_args == ARGS
    entry = c.journal.get(entry_id)
    assert entry is not None and entry["canary_verdict"] == "revert"
    assert entry["canary_share_before"] == 1.0 and entry["canary_share_after"] == 0.2
    assert c.canary is None
    asyncio.run(c.carry_out(revert))
    assert actor.calls[-1] == ("restart", "w1", ARGS)


def test_a_fixed_worker_keeps_its_fix_and_a_better_one_is_rolled_out(tmp_path: Path) -> None:
    c, clock, actor = _fleet(tmp_path / "fixed")
    slow = {**dict.fromkeys(WORKERS, (100, 3000.0)), "w1": (40, 1800.0)}  # w1 started with a small KV pool
    even = dict.fromkeys(WORKERS, (100, 3000.0))
    entry_id = _trial_then(c, clock, actor, {"mem_fraction_static": 0.88}, slow, even)
    assert c.tick() == [] and c.canary is None  # kept on w1, nothing to roll out
    entry = c.journal.get(entry_id)
    assert entry is not None and entry["canary_verdict"] == "keep" and entry["canary_share_before"] == 0.6
    assert len(actor.calls) == 1

    c, clock, actor = _fleet(tmp_path / "better")
    better = {**even, "w1": (130, 3600.0)}
    entry_id = _trial_then(c, clock, actor, {"schedule_conservativeness": 0.5}, even, better)
    rolled = []
    for _ in range(6):  # one worker at a time, each restarted before the next is started
        acts = c.tick()
        assert len(acts) <= 1
        for act in acts:
            assert act.decision.rule == "canary_promote"
            rolled.append(act.decision.worker_id)
            asyncio.run(c.carry_out(act))
    assert sorted(rolled) == ["w0", "w2", "w3"] and c.canary is None
    assert all(args["schedule_conservativeness"] == 0.5 for _, _, args in actor.calls)
    entry = c.journal.get(entry_id)
    assert entry is not None and entry["canary_verdict"] == "promote"


def test_a_trial_that_cannot_start_is_refused_in_words(tmp_path: Path) -> None:
    c, _, _ = _fleet(tmp_path)
    with pytest.raises(TrialRefused, match="no worker 'w9'"):
        c.trial("w9", {"max_running_requests": 4})
    with pytest.raises(TrialRefused, match="already runs"):
        c.trial("w1", {"model_path": ARGS["model_path"]})
    c.track(info("w2", WorkerState.STARTING))
    with pytest.raises(TrialRefused, match="w2 restarting or down"):
        c.trial("w1", {"max_running_requests": 4})
    c.track(info("w2"))
    c.trial("w1", {"max_running_requests": 4})
    with pytest.raises(TrialRefused, match="a canary is under way on w1"):
        c.trial("w0", {"max_running_requests": 8})

    advise, _ = controller(ControlMode.ADVISE, None)
    advise.track(info("w0"))
    advise.track(info("w1"))
    with pytest.raises(TrialRefused, match="only in auto"):
        advise.trial("w0", {"max_running_requests": 4})
    single, _ = controller(ControlMode.AUTO, None)
    single.track(info("w0"))
    with pytest.raises(TrialRefused, match="two or more managed workers"):
        single.trial("w0", {"max_running_requests": 4})


def test_a_clearly_worse_canary_is_reverted_once_its_evidence_is_in_not_after_the_window(tmp_path: Path) -> None:
    assert failing(0.2, 1.0, 0.5) and not failing(0.6, 1.0, 0.5) and not failing(0.2, 1.0, 0.0)
    assert not failing(None, 1.0, 0.5) and failing(0.2, None, 0.5)
    c, clock, _ = _fleet(tmp_path)
    even = dict.fromkeys(WORKERS, (100, 3000.0))
    _scrape(c, clock, 0.0, 30, even)
    act = c.trial("w1", {"max_running_requests": 4})
    asyncio.run(c.carry_out(act))
    start, evidence = clock.now, int(c.constants.min_evidence_s)
    _scrape(c, clock, start, evidence - 2, {**even, "w1": (4, 600.0)})
    assert c.tick() == []  # not enough evidence yet
    slightly = {**even, "w1": (90, 2400.0)}  # 0.8 of the others: worse, but not clearly: it waits for the window
    c2, clock2, _ = _fleet(tmp_path / "slightly")
    _scrape(c2, clock2, 0.0, 30, even)
    asyncio.run(c2.carry_out(c2.trial("w1", {"max_running_requests": 90})))
    _scrape(c2, clock2, clock2.now, evidence + 2, slightly)
    assert c2.tick() == [] and c2.canary is not None
    _scrape(c, clock, start, evidence + 2, {**even, "w1": (4, 600.0)})
    (revert,) = c.tick()
    assert revert.decision.rule == "canary_revert" and clock.now < c.constants.window_s + start
    entry = c.journal.get(act.entry_id)
    assert entry is not None and entry["canary_verdict"] == "revert"
    assert evidence <= entry["canary_failed_early_s"] < c.constants.window_s


def test_the_canary_reads_tokens_as_decoded_not_as_requests_finish() -> None:
    """Long outputs: no request of the worker finished within the window, so its finished-token
    counter stands still, while its engine decodes 1,500 tokens/s; the share reads the gauge."""
    from proxy.control.window import Window

    w = Window(span_s=60.0).begin(0.0)
    for k in range(21):
        w = w.push(Sample(time=float(k), queue=5, running=30, token_usage=0.6, generation_tokens_total=9000.0,
                          gen_throughput=1500.0))  # fmt: skip
    assert w.throughput is None or w.throughput == 0.0
    assert w.decode_rate == 1500.0
    counted = Window(span_s=60.0).begin(0.0)  # a worker that reports no gauge: the counter it is
    for k in range(21):
        counted = counted.push(Sample(time=float(k), queue=5, running=30, token_usage=0.6,
                                      generation_tokens_total=100.0 * k))  # fmt: skip
    assert counted.decode_rate == counted.throughput == 100.0


def test_a_worker_still_refilling_after_its_own_restart_is_no_yardstick_for_a_canary(tmp_path: Path) -> None:
    """A trial on w1 just after w0 came back from a restart: w0 serves a fifth of the others while it
    refills its batch, and read against all three w1 would look 1.36x the others before its restart
    (the fleet scenario: a canary's share read 0.97 before its restart against a worker just reverted,
    0.64 without it, and it was promoted on that). Its share is read against the workers that had
    served a whole window before the reading began, while there are any."""
    c, clock, actor = _fleet(tmp_path)
    even = dict.fromkeys(WORKERS, (100, 3000.0))
    window = int(c.constants.window_s)
    _scrape(c, clock, 0.0, 3 * window, even)
    c.track(info("w0", WorkerState.STARTING))
    clock.now += 5.0
    c.track(info("w0"))  # ready again: refilling
    _scrape(c, clock, clock.now, window, {**even, "w0": (20, 600.0)})
    act = c.trial("w1", {"schedule_conservativeness": 0.5})
    assert c.canary is not None and c.canary.before == 1.0  # against w2 and w3, which served throughout
    asyncio.run(c.carry_out(act))
    assert actor.calls[-1] == ("restart", "w1", {**ARGS, "schedule_conservativeness": 0.5})
    # with no worker that served a whole window before, the others are all that serve
    fresh, clock2, _ = _fleet(tmp_path / "fresh")
    _scrape(fresh, clock2, 0.0, window, {**even, "w0": (20, 600.0)})
    fresh.trial("w1", {"schedule_conservativeness": 0.5})
    assert fresh.canary is not None and fresh.canary.before == pytest.approx(3000.0 / 2200.0, abs=1e-3)
