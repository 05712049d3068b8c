"""The control loop on recorded inputs: modes, journaling, revival of dead workers, outcomes.

The controller is built as the app builds it, with fakes of what it reads of the world: SGLang's
own log reading and death classification, a log tail and a proxy backlog given by the test, an
actor that records what it was asked and answers like a pool would, and a clock the test moves.
The end-to-end tests (test_e2e_*.py) run the same controller against real simulated SGLang processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.control.constants import CONSTANTS
from proxy.control.controller import ActResult, Controller, Drain, LogReader
from proxy.control.journal import Journal, verdict
from proxy.control.offload import Offload, in_thread
from proxy.engines.base import Sample
from proxy.engines.sglang.engine import SIM
from proxy.engines.sglang.knobs import KNOBS
from proxy.engines.sglang.logs import Death, LogFollower, classify_death
from proxy.policy import ControlMode, ControlSettings
from proxy.workers.base import WorkerInfo, WorkerState
from tests.harness.static_pool import StaticPool

from .recorded import ENGINE_FIXTURES, log_events, samples

ARGS = {"model_path": "m", "schedule_conservativeness": 1.0, "chunked_prefill_size": 8192}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingActor:
    def __init__(self, come_back: WorkerState = WorkerState.READY) -> None:
        self.calls: list[tuple[str, str, dict[str, object]]] = []
        self.come_back = come_back

    async def restart(self, worker_id: str, args: Mapping[str, object], reason: str) -> ActResult:
        self.calls.append(("restart", worker_id, dict(args)))
        return ActResult(
            info=info(worker_id, self.come_back, args), drain=Drain(in_flight_at_drain=0, drained=True, drain_s=0.0)
        )

    async def revive(self, worker_id: str, args: Mapping[str, object], reason: str) -> ActResult:
        self.calls.append(("revive", worker_id, dict(args)))
        return ActResult(info=info(worker_id, self.come_back, args))


class SGLangLogs:
    """The engine side, as the app builds it for SGLang."""

    def log_reader(self) -> LogReader:
        return LogFollower()

    def classify_death(self, tail: Sequence[str]) -> Death:
        return classify_death(tail)


class Around:
    """The proxy around the controller: a worker's log tail and the requests its queue holds."""

    def __init__(self, *, tail: Sequence[str] = (), backlog: int = 0, for_class: int = 0) -> None:
        self.tail, self.held, self.for_class = list(tail), backlog, for_class
        self.budgets_held: dict[tuple[str, bool, int], int | None] = {}  # output budgets held back, as sent
        self.held_open: dict[str, int | None] = {}  # the most requests held open per budgeted worker
        self.queue_past: dict[str, bool] = {}  # per worker, its queue kept past its engine's prefix limit

    def log_tail(self, worker_id: str, lines: int) -> Sequence[str]:
        return self.tail[-lines:]

    def backlog(self) -> int:
        return self.held

    def held_for_class(self) -> int:
        return self.for_class

    def queue_gate(self, worker_id: str) -> tuple[int, float] | None:
        return None  # not known: the twin's replays queue at its engine as they arrive

    def prefix_first(self, worker_id: str) -> int:
        return 0

    def hold_back_budget(self, worker_id: str, interactive: bool, asked: int, tokens: int | None) -> None:
        self.budgets_held[(worker_id, interactive, asked)] = tokens

    def release_budget(self, worker_id: str, interactive: bool, asked: int) -> None:
        self.budgets_held.pop((worker_id, interactive, asked))

    def hold_open(self, worker_id: str, most: int | None) -> None:
        self.held_open[worker_id] = most

    def queue_sides(self, worker_id: str) -> tuple[int, int] | None:
        return None  # not known: no sides priced

    def prefixes_shared(self, worker_id: str) -> bool:
        return True

    def keep_queue_past(self, worker_id: str, past: bool) -> None:
        self.queue_past[worker_id] = past


def info(
    worker_id: str = "w0", state: WorkerState = WorkerState.READY, args: Mapping[str, object] = ARGS
) -> WorkerInfo:
    return WorkerInfo(id=worker_id, url="http://127.0.0.1:1", state=state, managed=True, args=dict(args), pid=4242)


# samples_conservative.json has about 300 requests on the worker, and as many wait in the proxy
WAITING = Around(backlog=500)


def controller(mode: ControlMode, tmp_path: Path | None, actor: RecordingActor | None = None, *, around: Around | None = None,
               hold: Callable[[str], object] = lambda worker_id: None, offload: Offload = in_thread,
               declare_down: Callable[[str, str], object] | None = None, clock_rate: float = 1.0,
               **kw: object) -> tuple[Controller, Clock]:  # fmt: skip
    """A controller built as the app builds it; ``tmp_path`` None: a journal in memory only. ``kw`` are
    [control] keys or, for the rest, the controller's constants (in the engine's seconds)."""
    clock = Clock()
    journal_path = str(tmp_path / "decisions.jsonl") if tmp_path is not None else None
    keys = {f.name for f in dataclasses.fields(ControlSettings)}
    settings = replace(ControlSettings(), mode=mode, journal_path=journal_path,
                       **{k: v for k, v in kw.items() if k in keys})  # type: ignore[arg-type]  # fmt: skip
    constants = replace(CONSTANTS, **{k: v for k, v in kw.items() if k not in keys})  # type: ignore[arg-type]
    c = Controller(
        settings, KNOBS, Journal(settings.journal_path, wall_clock=lambda: 1_800_000_000.0),
        engine=SGLangLogs(), surroundings=around or Around(), actor=actor or RecordingActor(), clock=clock,
        hold=hold, declare_down=declare_down, modelled=lambda args: SIM.modelled(args, ()), offload=offload,
        clock_rate=clock_rate, constants=constants,
    )  # fmt: skip
    return c, clock


def feed(c: Controller, clock: Clock, rows: list[Sample], worker_id: str = "w0") -> None:
    for s in rows:
        clock.now = s.time
        c.on_sample(worker_id, s)


def headroom(c: Controller, worker_id: str = "w0") -> None:
    """The worker's start-up line says 13.5 GB free: more than the band's top (a larger KV pool fits)."""
    for event in log_events("log_startup_headroom.log"):
        c.on_event(worker_id, event)


ROOMY = {**ARGS, "mem_fraction_static": 0.83}  # 13.5 GB free at start-up: 0.906 leaves the band's middle


def test_auto_acts_on_a_start_up_line_and_measures_the_outcome(tmp_path: Path) -> None:
    actor = RecordingActor()
    c, clock = controller(ControlMode.AUTO, tmp_path, actor)
    c.track(info(args=ROOMY))
    headroom(c)
    feed(c, clock, samples("samples_retraction_storm.json"))
    acts = c.tick()
    assert [a.decision.rule for a in acts] == ["memory_headroom"]
    asyncio.run(c.carry_out(acts[0]))
    assert actor.calls == [("restart", "w0", {**ROOMY, "mem_fraction_static": 0.906})]
    assert c.state("w0").args["mem_fraction_static"] == 0.906
    entry = c.journal.entries()[-1]
    assert entry["status"] == "applied" and entry["changes"] == {"mem_fraction_static": [0.83, 0.906]}
    assert entry["act"] == {"in_flight_at_drain": 0, "drained": True, "drain_s": 0.0, "taken_back": 0}
    assert entry["evidence"]["available_gpu_mem_gb"] == 13.5 and entry["outcome"]["before"]["throughput"] > 2000

    # the next incarnation runs healthy; a window later the outcome is filled in
    restarted = clock.now
    feed(c, clock, samples("samples_healthy.json", offset=restarted + 1))
    assert c.tick() == []  # cool-down, and nothing to fix anyway
    clock.now = restarted + 61 + CONSTANTS.window_s
    c.tick()
    entry = c.journal.entries()[-1]
    assert entry["outcome"]["after"]["retraction_rate_per_min"] < 2 and entry["outcome"]["verdict"] == "better"

    lines = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines] == ["acting", "applied", "applied"]  # decided, ready, outcome
    assert {line["id"] for line in lines} == {entry["id"]}


def test_a_retraction_storm_restarts_nothing_by_rule(tmp_path: Path) -> None:
    """The storm's restart is the planner's to price: the rules alone leave it be."""
    actor = RecordingActor()
    c, clock = controller(ControlMode.AUTO, tmp_path, actor, retractions_per_1k_tokens=0.1)
    c.track(info())
    feed(c, clock, samples("samples_retraction_storm.json"))
    assert c.tick() == [] and actor.calls == []


def test_advise_journals_once_and_never_restarts(tmp_path: Path) -> None:
    actor = RecordingActor()
    c, clock = controller(ControlMode.ADVISE, tmp_path, actor, around=WAITING)
    c.track(info(args=ROOMY))
    headroom(c)
    feed(c, clock, samples("samples_conservative.json"))
    assert c.tick() == []
    clock.now += 5
    assert c.tick() == []  # the same advice is not repeated within the cool-down
    entries = c.journal.entries()
    assert [(e["rule"], e["status"], e["mode"]) for e in entries] == [("memory_headroom", "advised", "advise")]
    assert entries[0]["changes"] == {"mem_fraction_static": [0.83, 0.906]}
    assert actor.calls == [] and c.state("w0").args["mem_fraction_static"] == 0.83


def test_off_only_observes(tmp_path: Path) -> None:
    c, clock = controller(ControlMode.OFF, tmp_path, RecordingActor())
    c.track(info())
    feed(c, clock, samples("samples_retraction_storm.json"))
    assert c.tick() == [] and c.journal.entries() == []
    assert c.window("w0").retraction_rate_per_min > 6  # still observed


def test_refusal_is_journaled_with_its_reason(tmp_path: Path) -> None:
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor(), restarts_per_hour=0)
    c.track(info(args=ROOMY))
    headroom(c)
    feed(c, clock, samples("samples_retraction_storm.json"))
    assert c.tick() == []
    entry = c.journal.entries()[-1]
    assert entry["status"] == "refused" and entry["detail"].startswith("restart budget spent")


def test_timid_pacing_is_noted_not_acted_on() -> None:
    c, clock = controller(ControlMode.AUTO, None, around=Around(backlog=400))
    c.track(info())
    feed(c, clock, samples("samples_idle.json"))
    assert c.tick() == []
    assert [(e["rule"], e["status"], e["action"]) for e in c.journal.entries()] == [
        ("pacing_too_timid", "noted", "note")
    ]
    # the same, but what the proxy holds is batch work its class's gates keep beside interactive work
    # (mixed's batch, held back beside the chat): nothing the band would send, no note
    c, clock = controller(ControlMode.AUTO, None, around=Around(backlog=400, for_class=400))
    c.track(info())
    feed(c, clock, samples("samples_idle.json"))
    assert c.tick() == [] and c.journal.entries() == []
    # nor while its planner holds it at its CUDA graphs' batch (by design too)
    c, clock = controller(ControlMode.AUTO, None, around=Around(backlog=400))
    c.track(info())
    c._workers["w0"].held_open = 160
    feed(c, clock, samples("samples_idle.json"))
    assert c.tick() == [] and c.journal.entries() == []


def test_death_by_prefill_oom_revives_with_a_smaller_chunk(tmp_path: Path) -> None:
    actor = RecordingActor()
    c, _ = controller(ControlMode.AUTO, tmp_path, actor, crash_backoff_s=(0.0,))
    c.track(info())
    for line in (ENGINE_FIXTURES / "sglang_crash_prefill_cuda_oom.log").read_text().splitlines()[:-1]:
        c.on_line("w0", line)  # the process exits before the parent's SIGQUIT line: the block is still open
    act = c.decide_revival("w0")
    assert act is not None
    assert act.revival and act.decision.rule == "prefill_oom"
    assert act.decision.changes == {"chunked_prefill_size": (8192, 4096)}
    asyncio.run(c.carry_out(act))
    assert actor.calls == [("revive", "w0", {**ARGS, "chunked_prefill_size": 4096})]
    entry = c.journal.entries()[-1]
    assert entry["status"] == "applied" and entry["reason"].startswith("worker died (out of memory in prefill)")


def test_death_classified_from_the_log_tail_when_no_line_was_followed() -> None:
    tail = (ENGINE_FIXTURES / "sglang_crash_decode_cuda_oom.log").read_text().splitlines()
    c, clock = controller(ControlMode.AUTO, None, around=Around(tail=tail))
    c.track(info(args={**ARGS, "max_running_requests": 600}))
    feed(c, clock, [Sample(time=1.0, queue=10, running=500, token_usage=0.9)])
    act = c.decide_revival("w0")
    assert act is not None
    assert act.decision.rule == "decode_oom" and act.decision.new_args["max_running_requests"] == 400


@pytest.mark.looptime
async def test_plain_crash_revives_with_same_args_and_backs_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor())
    c.track(info())
    delays = []
    for t in (10.0, 20.0, 30.0):
        clock.now = t
        for line in (ENGINE_FIXTURES / "sglang_crash_value_error.log").read_text().splitlines():
            c.on_line("w0", line)
        act = c.decide_revival("w0")
        assert act is not None
        assert act.decision.rule == "revive" and dict(act.decision.new_args) == ARGS
        delays.append(act.decision.delay_s)
        # the operator sees when it comes back: in the journal while it waits, and in the log
        assert (
            c.journal.get(act.entry_id)["detail"]
            == f"back in {act.decision.delay_s:g} s (crash back-off), then the start-up"
        )  # type: ignore[index]
        assert (
            "worker w0 died (crash: ValueError" in caplog.text
            and f"in {act.decision.delay_s:g} s (crash back-off)" in caplog.text
        )
        await c.carry_out(act)  # after its back-off (loop time)
        assert c.journal.get(act.entry_id)["status"] == "revived"  # type: ignore[index]
    assert delays == list(CONSTANTS.crash_backoff_s[:3])
    assert "ValueError: invalid sampling parameter" in c.journal.entries()[-1]["reason"]


def test_crash_loop_after_a_tuning_change_goes_back(tmp_path: Path) -> None:
    actor = RecordingActor()
    c, clock = controller(ControlMode.AUTO, tmp_path, actor, around=WAITING, crash_backoff_s=(0.0,))
    c.track(info(args=ROOMY))
    headroom(c)
    feed(c, clock, samples("samples_conservative.json"))
    [act] = c.tick()
    asyncio.run(c.carry_out(act))  # mem_fraction_static 0.83 -> 0.906
    rules = []
    for t in (100.0, 110.0, 120.0):
        clock.now = t
        act = c.decide_revival("w0")
        assert act is not None
        rules.append(act.decision.rule)
        asyncio.run(c.carry_out(act))
    assert rules == ["revive", "revive", "crash_loop"]
    assert actor.calls[-1] == ("revive", "w0", ROOMY)


# the pool's words for a worker started with an unknown flag (tests/workers/test_exit_text.py)
BAD_FLAG = "exited with code 2: pacer sim: error: unrecognized arguments: --no-such-flag"


def test_a_crash_loop_on_the_policys_own_args_is_noted_once_per_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The crash_loop rule has nothing to go back to (the worker runs the policy's arguments): each
    death only revives it. The loop is journaled and logged once, when it begins, with its deaths and
    the last cause; not at every death after; again once a later loop begins."""
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor(), crash_backoff_s=(0.0, 60.0))
    c.track(info())

    def die(t: float) -> None:
        clock.now = t
        act = c.decide_revival("w0", 2, BAD_FLAG)
        assert act is not None and act.decision.rule == "revive" and dict(act.decision.new_args) == ARGS

    for t in (10.0, 20.0, 30.0, 40.0, 50.0):
        die(t)
    notes = [e for e in c.journal.entries() if e["rule"] == "crash_loop"]
    assert [(e["status"], e["action"], e["evidence"]["deaths"]) for e in notes] == [("noted", "note", 3)]
    [note] = notes
    assert note["evidence"]["last_death"] == BAD_FLAG and note["evidence"]["fallback"] == "policy"
    assert note["reason"] == (
        f"crash loop: 3 deaths in 600 s, the last: {BAD_FLAG}; it runs the policy's arguments, nothing to go "
        "back to: revived after each death (crash back-off up to 60 s)"
    )
    assert caplog.text.count("crash loop: ") == 1
    # the revivals say why it died: the flag, not a bare exit code
    assert c.journal.entries()[-1]["reason"] == f"worker died ({BAD_FLAG}); restarting it with the same args"

    die(2000.0)  # long after: the loop is over
    for t in (2010.0, 2020.0):  # a new one begins
        die(t)
    assert [e["evidence"]["deaths"] for e in c.journal.entries() if e["rule"] == "crash_loop"] == [3, 3]

    for t in (5000.0, 5290.0, 5580.0, 5895.0, 6180.0, 6470.0, 6790.0):  # one loop of a death every ~300 s:
        die(t)  # 2 or 3 deaths in the window by turns, never 1
    assert [e["evidence"]["deaths"] for e in c.journal.entries() if e["rule"] == "crash_loop"] == [3, 3, 3]


async def test_a_crash_loop_no_rule_breaks_is_declared_to_the_pool(tmp_path: Path) -> None:
    """The pool hears of the loop as it is noted, so the request path refuses the pool's requests
    (with a Retry-After) instead of queueing them to their timeout; the revivals go on."""
    declared: list[tuple[tuple[object, ...], dict[str, object]]] = []
    actor = RecordingActor()
    c, clock = controller(ControlMode.AUTO, tmp_path, actor, crash_backoff_s=(0.0,),
                          declare_down=lambda *a, **kw: declared.append((a, kw)))  # fmt: skip
    c.track(info())
    for t in (10.0, 20.0, 30.0):
        assert declared == []
        clock.now = t
        c.track(dataclasses.replace(info(state=WorkerState.DOWN), exit_code=2, last_error=BAD_FLAG))
        for _ in range(5):  # the revival it spawned runs
            await asyncio.sleep(0)
    assert declared == [
        (("w0", "in a crash loop (3 deaths in 600 s): revived after each death, it serves once it starts"),
         {"for_good": False}),
    ]  # fmt: skip
    assert [call[0] for call in actor.calls] == ["revive"] * 3
    await c.close()


def test_a_revival_that_fails_keeps_the_end_of_why(tmp_path: Path) -> None:
    """The pool's words for a death are cut in the journal after how it ended, at the front of what
    it said: the end is what says why."""
    why = "exited with code 2: " + " | ".join(["[--sim-output-spread SIM_OUTPUT_SPREAD]"] * 40) + " | " + BAD_FLAG

    class DiesAgain(RecordingActor):
        async def revive(self, worker_id: str, args: Mapping[str, object], reason: str) -> ActResult:
            self.calls.append(("revive", worker_id, dict(args)))
            return ActResult(info=replace(info(worker_id, WorkerState.DOWN, args), exit_code=2, last_error=why))

    c, _ = controller(ControlMode.AUTO, tmp_path, DiesAgain(), crash_backoff_s=(0.0,))
    c.track(info())
    act = c.decide_revival("w0", 2)
    assert act is not None

    async def go() -> None:
        await c.carry_out(act)
        await c.close()  # the revival its death spawned

    asyncio.run(go())
    detail = c.journal.get(act.entry_id)["detail"]  # type: ignore[index]
    assert detail.startswith("w0 is down: exited with code 2: …") and detail.endswith(BAD_FLAG) and len(detail) < 1100


def test_advise_revives_a_dead_worker_as_it_was_and_journals_the_rules_change_as_advice(tmp_path: Path) -> None:
    """A fleet in advise must not stay dead: the worker comes back with its own arguments (advise
    changes none), and what the death's rule would change is advice in the journal."""
    actor = RecordingActor()
    c, _ = controller(ControlMode.ADVISE, tmp_path, actor)
    c.track(info())
    for line in (ENGINE_FIXTURES / "sglang_crash_prefill_allocator.log").read_text().splitlines():
        c.on_line("w0", line)
    act = c.decide_revival("w0", exit_code=1)
    assert act is not None and act.revival
    assert act.decision.rule == "revive" and dict(act.decision.new_args) == ARGS
    advice, revival = c.journal.entries()
    assert (advice["rule"], advice["status"], advice["changes"]) == (
        "prefill_oom",
        "advised",
        {"chunked_prefill_size": [8192, 4096]},
    )
    assert advice["detail"] == "advice (mode advise): the worker comes back with its own arguments"
    assert (revival["rule"], revival["status"]) == ("revive", "acting")


def test_revive_false_leaves_a_dead_worker_down(tmp_path: Path) -> None:
    given_up: list[tuple[str, str]] = []
    c, _ = controller(
        ControlMode.AUTO, tmp_path, RecordingActor(), revive=False, declare_down=lambda *a: given_up.append(a)
    )
    c.track(info())
    c.track(info(state=WorkerState.DOWN))
    [entry] = c.journal.entries()
    assert (entry["status"], entry["detail"]) == ("advised", "the worker stays down (revive = false)")
    assert given_up == [("w0", "it stays down (control.revive = false)")]  # the pool refuses its requests
    c.track(dataclasses.replace(info(state=WorkerState.DOWN), stays_down=True))  # the pool saying so: no second death
    assert len(c.journal.entries()) == 1 and given_up == [("w0", "it stays down (control.revive = false)")]


async def test_a_death_with_nothing_in_its_log_is_told_by_how_the_process_ended(tmp_path: Path) -> None:
    """No crash or OOM line, followed or in the tail: the journal says what the exit said (kill -9, an
    exit code), not a bare 'exited'."""
    for code, said in [(-9, "killed by SIGKILL"), (3, "exited with code 3"), (None, "exited")]:
        c, _ = controller(ControlMode.AUTO, tmp_path / str(code), RecordingActor(), crash_backoff_s=(0.0,))
        c.track(info())
        c.track(dataclasses.replace(info(state=WorkerState.DOWN), exit_code=code))
        (entry,) = c.journal.entries()
        assert entry["rule"] == "revive" and entry["reason"].startswith(f"worker died ({said});"), entry["reason"]
        assert entry["evidence"]["death"] == said
        await c.close()


def test_off_records_the_death_only_and_says_the_worker_stays_down(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    given_up: list[tuple[str, str]] = []
    c, clock = controller(ControlMode.OFF, tmp_path, RecordingActor(), declare_down=lambda *a: given_up.append(a))
    c.track(info())
    clock.now = 5.0
    with caplog.at_level(logging.WARNING, logger="proxy.control.revival"):
        c.track(info(state=WorkerState.DOWN))
    assert given_up == [("w0", "it stays down (control.mode = off)")]
    c.track(dataclasses.replace(info(state=WorkerState.DOWN), stays_down=True))
    assert c.journal.entries() == [] and c.state("w0").deaths == (5.0,)
    assert not (tmp_path / "decisions.jsonl").exists()
    assert "worker w0 died (exited): it stays down (control.mode = off" in caplog.text  # not a silent outage


def test_restart_that_fails_is_journaled(tmp_path: Path) -> None:
    actor = RecordingActor(come_back=WorkerState.DOWN)
    c, clock = controller(ControlMode.AUTO, tmp_path, actor)
    c.track(info(args=ROOMY))
    headroom(c)
    feed(c, clock, samples("samples_retraction_storm.json"))
    [act] = c.tick()

    async def go() -> None:
        await c.carry_out(act)
        await c.close()  # the revival it spawned

    asyncio.run(go())
    first = c.journal.get(act.entry_id)
    assert first is not None and first["status"] == "failed" and "down" in first["detail"]
    assert c.journal.entries()[-1]["rule"] == "revive"


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (
            {"throughput": 1000.0, "retraction_rate_per_min": 20.0},
            {"throughput": 1200.0, "retraction_rate_per_min": 0.0},
            "better",
        ),
        (
            {"throughput": 1000.0, "retraction_rate_per_min": 0.0},
            {"throughput": 800.0, "retraction_rate_per_min": 0.0},
            "worse",
        ),
        (
            {"throughput": 1000.0, "retraction_rate_per_min": 20.0},
            {"throughput": 1010.0, "retraction_rate_per_min": 2.0},
            "better",
        ),
        (
            {"throughput": 1000.0, "retraction_rate_per_min": 1.0},
            {"throughput": 1000.0, "retraction_rate_per_min": 1.0},
            "same",
        ),
        (
            {"throughput": None, "retraction_rate_per_min": 0.0},
            {"throughput": 5.0, "retraction_rate_per_min": 9.0},
            "worse",
        ),
    ],
)
def test_verdict(before: dict[str, object], after: dict[str, object], expected: str) -> None:
    assert verdict(before, after) == expected


def test_a_dying_worker_is_held_until_ready_again() -> None:
    """The controller holds a dying worker in the pool (its state, the one truth of 'send nothing');
    the pool's hold is lifted by the worker's restart, not by the controller."""
    pool = StaticPool(["http://w0"])
    c, _ = controller(ControlMode.OFF, None, hold=pool.hold)
    c.track(info())
    c.on_line(
        "w0",
        "[2026-09-13 16:12:40] Decode batch, #running-req: 5, #token: 1, token usage: 0.10, cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0",
    )
    assert pool.get("w0").state is WorkerState.READY
    for line in (ENGINE_FIXTURES / "sglang_crash_prefill_allocator.log").read_text().splitlines():
        c.on_line("w0", line)
    assert pool.get("w0").state is WorkerState.DRAINING
    pool.set_state("w0", WorkerState.DOWN)
    c.track(info(state=WorkerState.DOWN))
    assert pool.hold("w0").state is WorkerState.DOWN  # a hold never revives a dead worker
    pool.set_state("w0", WorkerState.READY)
    c.track(info(state=WorkerState.READY))
    assert pool.get("w0").state is WorkerState.READY
