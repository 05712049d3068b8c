"""Each pool's fast tier, wired to the request path: it reads the board after every scrape and writes back.

:func:`fast_tier` is the observer the scraper calls with each worker's sample: it gathers what the
board holds of the worker's load into a :class:`proxy.control.fast_decision.LoadReading`, lets the
pool's :class:`proxy.control.fast_decision.FastTier` decide, and applies the decision to the board.
:func:`look_again` runs the same look on demand. Part of the composition root
(:mod:`proxy.compose`), kept apart so the wiring of one tier reads on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from proxy.control.evidence import OutputBudget
from proxy.control.fast_decision import BudgetReading, FastTier, LoadReading
from proxy.control.fast_tier import PaceSettings
from proxy.engines.base import Sample
from proxy.engines.contract import Engine
from proxy.request.admission import AdmissionQueue, Priority
from proxy.request.continuation import applies_above
from proxy.request.dispatch import Dispatcher
from proxy.request.fast_board import apply_decision
from proxy.request.pacing import LoadBoard, SampleObserver, WorkerLoad
from proxy.workers.base import WorkerPool
from proxy.workers.fleet import PoolView

__all__ = ["BudgetJournal", "fast_tier", "load_reading", "look_again"]


BudgetJournal = Callable[[str, OutputBudget, float], None]


def fast_tier(
    board: LoadBoard,
    dispatcher: Dispatcher,
    settings: PaceSettings | None = None,
    journal: BudgetJournal | None = None,
    engine: Engine | None = None,
) -> SampleObserver:
    """After each scrape of one of ``dispatcher``'s workers, that pool's fast tier
    (:class:`proxy.control.fast_decision.FastTier`) decides from what the board holds of the worker,
    and the decision is written to the board (:func:`proxy.request.fast_board.apply_decision`); the
    budgets that moved go to the journal. Samples of other pools' workers are not its to pace.
    ``engine``: the pool's, for what its admission reserves (None: nothing is counted reserved)."""
    band = dispatcher.band
    tier = FastTier(
        settings or PaceSettings(), lo=band.lo, hi=band.hi, headroom=band.headroom, applies_above=applies_above
    )

    def observe(worker_id: str, sample: Sample | None, _error: str | None) -> None:
        if sample is None or not _serves(dispatcher.pool, worker_id):
            return
        load = board.get(worker_id)
        reading = load_reading(tier, worker_id, sample, load, dispatcher.admission, engine)
        decision = tier.decide(worker_id, sample, reading)
        apply_decision(worker_id, decision, load, dispatcher)
        if journal is not None:
            for evidence in decision.evidence:
                journal(worker_id, evidence, sample.time)

    return observe


def load_reading(
    tier: FastTier,
    worker_id: str,
    sample: Sample,
    load: WorkerLoad,
    admission: AdmissionQueue,
    engine: Engine | None = None,
) -> LoadReading:
    """What the fast tier reads of a worker's load, over the facts' window before ``sample``: the
    time-to-first-token from the interactive class's requests sent since the last back-off; the
    open requests of each class when a batch is open beside a known step time; each output budget's
    cohort, from the answers of requests that arrived before the oldest of their class still open (a
    wave's first answers are its shortest: a budget read from them alone would be cut short); and
    with those, what ``engine``'s admission counts taken, where it reserves KV for what requests may write."""
    since = sample.time - tier.settings.facts_window_s
    facts, budgets, step = load.facts, load.output_budgets, load.engine_step_s()
    open_batch: tuple[tuple[int, int], ...] | None = None
    open_chat: tuple[tuple[int, int], ...] = ()
    admitted: tuple[float | None, float | None] = (None, None)
    if step is not None and sample.max_total_tokens and load.batch_in_flight:

        def expected(interactive: bool) -> tuple[float | None, float | None]:
            return facts.mean_prompt_tokens(since, interactive), facts.mean_output_tokens(since, interactive)

        open_batch = tuple(load.open_requests(sample.time, step, expected, interactive=False))
        open_chat = tuple(load.open_requests(sample.time, step, expected, interactive=True))
        if engine is not None and engine.reserves_max_tokens:
            admitted = _admission(engine, sample, load, step, since)
    oldest = {True: math.inf, False: math.inf}
    for attempt in load.attempts:
        interactive = attempt.ticket.priority is Priority.INTERACTIVE
        oldest[interactive] = min(oldest[interactive], attempt.ticket.enqueued_at)
    cohorts: list[BudgetReading] = []
    for interactive in (True, False):
        by_asked = facts.written(
            interactive=interactive,
            arrived_before=oldest[interactive],
            arrived_from=budgets.read_from_of(interactive=interactive),
        )
        for asked in sorted(set(by_asked) | set(budgets.asked(interactive=interactive))):
            key = (interactive, asked)
            within = facts.ended_within_budget(
                interactive=interactive, max_tokens=asked, sent_after=budgets.set_at(key), ended_since=since
            )
            written = tuple(by_asked.get(asked, []))
            reached = budgets.reached(key, since=since)
            cohorts.append(
                BudgetReading(
                    interactive=interactive,
                    asked=asked,
                    written=written,
                    current=budgets.get(key),
                    reached=reached,
                    ended_within=within,
                )
            )
    return LoadReading(
        in_flight=load.in_flight,
        batch_in_flight=load.batch_in_flight,
        backlog=len(admission),
        interactive_waiting=load.interactive_in_flight + admission.depth(Priority.INTERACTIVE),
        mean_output_tokens=facts.mean_output_tokens(since),
        ttft_s=facts.mean_ttft(since, interactive=True, sent_after=tier.backed_off_at(worker_id)),
        interactive_output_tokens=facts.mean_output_tokens(since, interactive=True),
        step_s=step,
        open_batch=open_batch,
        open_interactive=open_chat,
        admission_share=admitted[0],
        batch_admission_share=admitted[1],
        budgets=tuple(cohorts),
        held_open=load.held_open,
    )


def _admission(
    engine: Engine, sample: Sample, load: WorkerLoad, step: float, since: float
) -> tuple[float, float | None]:
    """:meth:`WorkerLoad.admission_shares` by ``engine``'s rule at the ratio ``sample`` shows."""
    ratio = sample.new_token_ratio

    def reserve(held: int, may_write: int, running: bool) -> int:
        return engine.admission_reserve(held, may_write, running=running, ratio=ratio)

    def prompt_of(interactive: bool) -> float | None:
        return load.facts.mean_prompt_tokens(since, interactive)

    return load.admission_shares(sample.time, step, prompt_of, reserve, sample.max_total_tokens or 1)


def look_again(board: LoadBoard, dispatcher: Dispatcher, fast_tier: SampleObserver) -> Callable[[], None]:
    """The fast tier's look at each of ``dispatcher``'s workers on its latest sample, now: for the first
    interactive request after a quiet spell, so the batch the worker was given in the meantime is
    stepped back before the request is placed, and batch work arriving with the chat is held to the
    batch's target beside it, not from the next scrape on (until then, up to a scrape interval, the
    batch goes on filling the worker's queue and KV ahead of the chat). A look adds no growth to the
    admission limit (it grows by the time since the last look)."""

    def look() -> None:
        for worker in dispatcher.pool.workers():
            sample = board.get(worker.id).sample
            if sample is not None:
                fast_tier(worker.id, sample, None)

    return look


def _serves(pool: WorkerPool, worker_id: str) -> bool:
    """Whether ``worker_id`` is one of ``pool``'s workers (a pool view holds only its pool's)."""
    return not isinstance(pool, PoolView) or any(w.id == worker_id for w in pool.workers())
