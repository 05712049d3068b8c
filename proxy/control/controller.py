"""The control loop: observe every worker, run the rules, act through an :class:`Actor`, journal it all.

Observation is synchronous and cheap (called from the scraper's sample observers, the
supervisor's line listeners and its state listeners): it only pushes into each worker's
:class:`~proxy.control.window.Window`. Decisions are taken in :meth:`Controller.tick` (serving
workers, every ``interval_s``) and :meth:`Controller.decide_revival` (a worker died); both are
synchronous and only read windows and states, so tests drive them with recorded inputs and no
event loop. :meth:`Controller.run` is the async part: it ticks, and hands each :class:`Act` to
:meth:`Controller.carry_out`, one worker at a time.

What the controller needs of the world around it is passed in, each a small protocol: the engine's
log reading and death classification (:class:`EngineLogs`), the pool's log tail and the proxy
queue's backlog (:class:`Surroundings`), an :class:`Actor` that restarts a worker, and a clock.
The composition root passes the real ones; tests pass fakes of the same protocols.

Modes (``[control] mode``):

* ``auto``: decisions are acted on (rolling restart with the new args);
* ``advise``: decisions are journaled as ``advised``, nothing is restarted for tuning;
* ``off``: windows are kept (the figures stay visible), no rule runs.

A worker this proxy does not manage (an external one) is never restarted: what ``auto`` would do
to it is journaled as ``advised``.

A managed worker that dies is revived in ``auto`` (unless ``revive = false``) after a back-off
that grows with its recent deaths, with the death rules' safer arguments (a smaller prefill chunk
after a prefill OOM...) or, without a rule, its current ones; ``advise`` journals that revival.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from proxy.control.decision import Action, ControlState, Decision, RuleKind
from proxy.control.evidence import Death
from proxy.control.journal import Journal, Status, verdict
from proxy.control.rules import ON_DEATH, WHILE_SERVING, RuleSettings, evaluate, revive_delay
from proxy.control.window import Window
from proxy.engines.base import EventKind, Knob, KnobName, LogEvent, Sample
from proxy.engines.contract import LogReader
from proxy.policy import ControlMode, ControlSettings
from proxy.workers.base import WorkerId, WorkerInfo, WorkerState

__all__ = ["Act", "ActResult", "Actor", "Controller", "DeathReport", "Drain", "EngineLogs", "LogReader", "Surroundings"]

_log = logging.getLogger(__name__)
_TAIL_LINES = 300


@dataclass(frozen=True, slots=True)
class Drain:
    """What a rolling restart's drain did before the restart (the journal entry's ``act``)."""

    in_flight_at_drain: int  # requests open on the worker when it stopped getting new ones
    drained: bool  # all of them finished before the restart
    drain_s: float  # how long the drain waited
    taken_back: int = 0  # not drained: requests without output taken back to the proxy queue
    still_running_at_restart: int | None = None  # not drained: streams with output still open at the restart
    drain_stopped: str | None = None  # why the drain ended early (too few finished in a slice)

    def to_json(self) -> dict[str, object]:
        """The journal's shape: the figures that apply (``None`` ones left out)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, slots=True)
class ActResult:
    info: WorkerInfo  # the worker after the restart: READY, or DOWN if it did not come back
    drain: Drain | None = None  # a rolling restart's drain (None: a revival, nothing to drain)


class Actor(Protocol):
    async def restart(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        """Rolling restart of a serving worker: drain, take back, restart, resume."""

    async def revive(self, worker_id: WorkerId, args: Mapping[str, object], reason: str) -> ActResult:
        """Restart a worker that died."""


class DeathReport(Protocol):
    """Why a worker died, as its engine reads the log tail (``proxy.engines.<engine>.logs.Death``)."""

    @property
    def cause(self) -> str: ...  # "oom", "crash", "watchdog", "kv_capacity"... or "unknown"

    @property
    def phase(self) -> str: ...  # for "oom": "prefill", "decode" or "unknown"

    @property
    def detail(self) -> str: ...  # the exception or line that says so


class EngineLogs(Protocol):
    """What the controller reads through the engine's module."""

    def log_reader(self) -> LogReader:
        """A reader for one worker's log lines (a new one per worker: a reader may keep state)."""

    def classify_death(self, tail: Sequence[str]) -> DeathReport | None:
        """Why a worker died, from the last lines of its log; None: this engine cannot tell."""


class Surroundings(Protocol):
    """What the controller reads of the proxy around it."""

    def log_tail(self, worker_id: WorkerId, lines: int) -> Sequence[str]:
        """The last ``lines`` lines of a worker's output (none for a worker this proxy did not start)."""

    def backlog(self) -> int:
        """Requests waiting in the proxy's own queue."""


@dataclass(slots=True)
class _Worker:
    state: ControlState
    window: Window
    reader: LogReader | None  # None: not managed, no log to read
    managed: bool
    busy: bool = False  # an act or a revival is under way
    pending_outcome: tuple[int, float] | None = None  # (journal id, due time)


@dataclass(frozen=True, slots=True)
class Act:
    """A decision to carry out (:meth:`Controller.carry_out`), journaled as ``acting`` under ``entry_id``."""

    decision: Decision
    entry_id: int
    revival: bool = False  # the worker died: nothing to drain


class Controller:
    def __init__(
        self,
        settings: ControlSettings,
        knobs: Mapping[KnobName, Knob],
        journal: Journal,
        *,
        engine: EngineLogs,
        surroundings: Surroundings,
        actor: Actor,
        clock: Callable[[], float],
        hold: Callable[[WorkerId], object],
    ) -> None:
        self.settings = settings
        self.rules = RuleSettings(control=settings, knobs=knobs)
        self.journal = journal
        self.engine = engine
        self.surroundings = surroundings
        self.actor = actor
        self._hold = hold  # send a worker nothing more until it starts again (the pool's hold)
        self.clock = clock
        self._workers: dict[WorkerId, _Worker] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def mode(self) -> ControlMode:
        return self.settings.mode

    # -- observation ------------------------------------------------------------------------------

    def track(self, info: WorkerInfo) -> None:
        """Follow a worker (idempotent); called for every state change the pool announces."""
        now = self.clock()
        w = self._workers.get(info.id)
        if w is None:
            reader = self.engine.log_reader() if info.managed else None
            w = self._workers[info.id] = _Worker(
                state=ControlState.initial(info.id, dict(info.args), now if info.state is WorkerState.READY else None),
                window=Window(span_s=self.settings.window_s),
                reader=reader,
                managed=info.managed,
            )
        if info.state is WorkerState.STARTING:
            w.window = w.window.restart(now)
            w.state = w.state.without_resolved()
        elif info.state is WorkerState.READY and w.state.started_at is None:
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
        if info.state is WorkerState.DOWN and w.managed and not w.busy:
            self._on_death(info.id)

    def on_sample(self, worker_id: WorkerId, sample: Sample | None, error: str | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is None or sample is None:
            return
        w.window = w.window.push(sample).push_proxy_queue(sample.time, self.surroundings.backlog())

    def on_line(self, worker_id: WorkerId, line: str) -> None:
        w = self._workers.get(worker_id)
        if w is None or w.reader is None:
            return
        for event in w.reader.feed(line, self.clock()):
            self.on_event(worker_id, event)

    def on_event(self, worker_id: WorkerId, event: LogEvent) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.window = w.window.push(event)
        if event.kind in (EventKind.OOM, EventKind.CRASH) and w.managed:
            # the server is going down (an OOM or a scheduler exception kills it): send it nothing more,
            # so requests are not retried against its closing port; its exit and restart lift the hold
            self._hold(worker_id)

    def window(self, worker_id: WorkerId) -> Window:
        return self._workers[worker_id].window

    def state(self, worker_id: WorkerId) -> ControlState:
        return self._workers[worker_id].state

    def set_resolved(self, worker_id: WorkerId, values: Mapping[str, float]) -> None:
        """Values the engine chose for unset args (e.g. from its ``/server_info``)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.state = w.state.with_resolved(values)

    # -- decisions (synchronous) ------------------------------------------------------------------

    def tick(self) -> list[Act]:
        """Run the serving rules for every serving worker; returns the acts for ``auto`` to carry out."""
        now = self.clock()
        acts: list[Act] = []
        others_down = any(w.managed and (w.busy or w.state.started_at is None) for w in self._workers.values())
        for w in self._workers.values():
            w.window = w.window.at(now)
            self._measure_outcome(w, now)
            if w.busy or w.state.started_at is None:
                continue
            if w.state.last_good_args != w.state.args and now - w.state.started_at >= self.settings.good_after_s:
                w.state = w.state.mark_good()
            if self.mode is ControlMode.OFF:
                continue
            evaluation = evaluate(w.window, w.state, self.rules, WHILE_SERVING)
            for decision, why in evaluation.refused:
                self._journal_once(
                    w, decision, f"refused:{decision.rule}:{why.split(':')[0]}", now, status=Status.REFUSED, detail=why
                )
            chosen = evaluation.decision
            if chosen is None:
                continue
            if chosen.action is Action.NOTE:
                self._journal_once(
                    w, chosen, f"note:{chosen.rule}", now, status=Status.NOTED, span=self.settings.window_s
                )
                continue
            if self.mode is ControlMode.ADVISE or not w.managed:
                why = "" if self.mode is ControlMode.ADVISE else "worker is not managed by this proxy"
                self._journal_once(w, chosen, f"advise:{chosen.rule}", now, status=Status.ADVISED, detail=why)
                continue
            if others_down and len(self._workers) > 1:
                self._journal_once(w, chosen, f"wait:{chosen.rule}", now, status=Status.REFUSED,
                                   detail="another worker is restarting or down: one at a time")  # fmt: skip
                continue
            entry_id = self.journal.record(chosen, mode=self.mode, status=Status.ACTING, before=w.window.summary())
            w.busy = True
            others_down = True
            acts.append(Act(decision=chosen, entry_id=entry_id))
        return acts

    def decide_revival(self, worker_id: WorkerId) -> Act | None:
        """A managed worker died: classify, count, and choose the args it comes back with.

        Returns the revival to carry out (``auto`` with ``revive``), else None: ``advise`` journals
        what it would do, ``off`` only records the death.
        """
        now = self.clock()
        w = self._workers[worker_id]
        if w.reader is not None:
            for event in w.reader.flush(now):
                w.window = w.window.push(event)
        cause = self._death_cause(worker_id, w, now)
        w.state = w.state.after_death(now)
        if self.mode is ControlMode.OFF:
            return None
        delay = revive_delay(w.state, self.settings, now)
        deaths = w.state.deaths_within(now, self.settings.crash_loop_window_s)
        chosen = evaluate(w.window.at(now), w.state, self.rules, ON_DEATH).decision
        if chosen is not None:
            decision = Decision(
                worker_id=chosen.worker_id, rule=chosen.rule, reason=f"worker died ({cause}); {chosen.reason}", time=now,
                evidence=Death(rule=chosen.evidence, death=cause, deaths_in_window=deaths),
                old_args=chosen.old_args, new_args=chosen.new_args, kind=chosen.kind, change=chosen.change,
                delay_s=max(delay, chosen.delay_s),
            )  # fmt: skip
        else:
            decision = Decision(
                worker_id=worker_id, rule="revive", reason=f"worker died ({cause}); restarting it with the same args",
                time=now, evidence=Death(death=cause, deaths_in_window=deaths),
                old_args=w.state.args, new_args=w.state.args, kind=RuleKind.SAFETY, delay_s=delay,
            )  # fmt: skip
        if self.mode is ControlMode.ADVISE or not self.settings.revive:
            why = "mode advise" if self.mode is ControlMode.ADVISE else "revive = false"
            self.journal.record(
                decision,
                mode=self.mode,
                status=Status.ADVISED,
                detail=f"the worker stays down ({why})",
                before=w.window.summary(),
            )
            return None
        entry_id = self.journal.record(decision, mode=self.mode, status=Status.ACTING, before=w.window.summary())
        w.busy = True
        return Act(decision=decision, entry_id=entry_id, revival=True)

    def _death_cause(self, worker_id: WorkerId, w: _Worker, now: float) -> str:
        """In words, from the window's events; the log tail is read when the follower saw nothing."""
        oom, crash = w.window.last(EventKind.OOM), w.window.last(EventKind.CRASH)
        if oom is not None:
            return f"out of memory in {oom.fields.get('phase', 'unknown')}"
        if crash is not None:
            return f"crash: {crash.fields.get('exception') or crash.line.splitlines()[0][:160]}"
        death = self.engine.classify_death(self.surroundings.log_tail(worker_id, _TAIL_LINES))
        if death is None or death.cause == "unknown":
            return "exited"
        if death.cause == "oom":
            w.window = w.window.push(
                LogEvent(
                    kind=EventKind.OOM, time=now, fields={"phase": death.phase, "cause": "log_tail"}, line=death.detail
                )
            )
            return f"out of memory in {death.phase}"
        return f"{death.cause}: {death.detail}"[:200]

    def _measure_outcome(self, w: _Worker, now: float) -> None:
        if w.pending_outcome is None or w.busy:
            return
        entry_id, due = w.pending_outcome
        if now < due or w.window.observed_s < self.settings.min_evidence_s:
            return
        w.pending_outcome = None
        entry = self.journal.get(entry_id)
        after = w.window.summary()
        before = (entry or {}).get("outcome", {}) or {}
        self.journal.update(entry_id, outcome={"after": after, "verdict": verdict(before.get("before") or {}, after)})

    def _journal_once(
        self,
        w: _Worker,
        decision: Decision,
        key: str,
        now: float,
        *,
        status: Status,
        detail: str = "",
        span: float | None = None,
    ) -> None:
        """Journal a decision that is not acted on, once per ``span`` (default: the cool-down)."""
        span = self.settings.cooldown_s if span is None else span
        last = w.state.noted.get(key)
        if last is not None and now - last < max(span, self.settings.interval_s):
            return
        w.state = w.state.note(key, now)
        self.journal.record(decision, mode=self.mode, status=status, detail=detail, before=w.window.summary())

    # -- acting (async) ---------------------------------------------------------------------------

    def _on_death(self, worker_id: WorkerId) -> None:
        act = self.decide_revival(worker_id)
        if act is not None:
            self._spawn(self.carry_out(act))

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled; acts run one at a time."""
        try:
            while True:
                for act in self.tick():
                    await self.carry_out(act)
                await asyncio.sleep(self.settings.interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def carry_out(self, act: Act) -> None:
        """Restart (or revive) the worker through the actor, then journal how it came back."""
        d = act.decision
        w = self._workers[d.worker_id]
        try:
            if d.delay_s > 0:
                await asyncio.sleep(d.delay_s)
            w.window = w.window.restart(self.clock())
            call = self.actor.revive if act.revival else self.actor.restart
            result = await call(d.worker_id, d.new_args, d.reason)
        except asyncio.CancelledError:
            self.journal.update(act.entry_id, status=Status.FAILED, detail="cancelled (the proxy is stopping)")
            raise
        except Exception as exc:  # a refused restart (bad args, external worker): keep serving as before
            _log.warning("restart of %s for %s failed: %s", d.worker_id, d.rule, exc)
            self.journal.update(act.entry_id, status=Status.FAILED, detail=f"{exc.__class__.__name__}: {exc}")
            w.busy = False
            return
        now = self.clock()
        info = result.info
        w.state = w.state.after_restart(d, now, self.settings.flip_guard_s)
        w.busy = False
        details = result.drain.to_json() if result.drain is not None else None
        if info.state is WorkerState.READY:
            w.window = w.window.begin(now)
            w.state = w.state.serving(now)
            status = Status.REVIVED if act.revival and d.rule == "revive" else Status.APPLIED
            self.journal.update(
                act.entry_id, status=status, detail=f"{d.worker_id} ready (pid {info.pid})", act=details
            )
            w.pending_outcome = (act.entry_id, now + self.settings.window_s)
        else:
            detail = f"{d.worker_id} is {info.state}: {info.last_error or ''}"[:500]
            self.journal.update(act.entry_id, status=Status.FAILED, detail=detail, act=details)
            if info.state is WorkerState.DOWN:
                self._on_death(d.worker_id)
