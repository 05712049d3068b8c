"""The fast tier as an object: one look at one worker in, one immutable decision out.

A look is the worker's scrape and what the proxy holds of it, read as plain values
(:class:`LoadReading`). The decision (:class:`FastDecision`) is its pace (admission limit, queue
targets, batch limit), the batch requests to take back, its output budgets and the journal's
evidence of those that moved. :class:`FastTier` remembers each worker's pace between looks and
nothing else; writing a decision to the load board and pumping the gate is the request path's.
The rules themselves are :mod:`proxy.control.fast_tier`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from proxy.control.evidence import OutputBudget
from proxy.control.fast_tier import (
    Pace,
    PaceInput,
    PaceSettings,
    budget_evidence,
    budget_moved,
    budget_overrun,
    held_open,
    kv_peak,
    next_pace,
    output_budget,
)
from proxy.engines.base import Sample

OpenRequests = tuple[tuple[int, int], ...]  # per open request: (KV tokens it holds, output tokens still to write)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReading:
    """One output budget's cohort: a class's answers that asked for ``asked`` tokens."""

    interactive: bool
    asked: int
    written: tuple[int, ...]  # output tokens of its whole cohorts' answers, oldest first
    current: int | None  # the budget now (None: none)
    reached: int  # the answers that reached it over the facts' window
    ended_within: int  # those sent under it that ended within it, over the same window


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReading:
    """What the proxy holds of one worker at a look, as plain values."""

    in_flight: int
    batch_in_flight: int
    backlog: int  # requests waiting in the pool's queue
    interactive_waiting: int  # interactive requests open on the worker or waiting for it
    mean_output_tokens: float | None
    ttft_s: float | None  # of interactive requests sent since the last back-off (:meth:`FastTier.backed_off_at`)
    interactive_output_tokens: float | None
    step_s: float | None
    # the open requests of each class, when a batch is open beside a known step time (else None)
    open_batch: OpenRequests | None = None
    open_interactive: OpenRequests = ()
    # as shares of the pool, where the engine's admission reserves KV for what requests may write (else
    # None): what it counts taken by the open requests plus what the next interactive one needs, and
    # what one more batch request counts once running
    admission_share: float | None = None
    batch_admission_share: float | None = None
    budgets: tuple[BudgetReading, ...] = ()
    held_open: int | None = None  # the most requests to hold open: its CUDA graphs' batch (the planner's look)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetMove:
    """An output budget's value after a look: ``tokens`` (None: none), or lifted as overrun (read
    again from the answers that come next)."""

    interactive: bool
    asked: int
    tokens: int | None
    overrun: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class FastDecision:
    """What one look decides for one worker."""

    time: float
    limit: int | None
    queue_target: int | None
    batch_queue_target: int | None
    batch_limit: int | None
    first_token_wait_s: float | None
    take_back_batch: int  # the newest batch requests open on the worker to take back
    kv_peak_share: float | None  # the KV ahead as a share of the pool (None: not sized)
    budgets: tuple[BudgetMove, ...]
    evidence: tuple[OutputBudget, ...]  # the budgets that moved enough for the journal
    reason: str  # why the limit last moved


class FastTier:
    """One pool's fast tier: ``decide`` after each scrape of one of its workers. ``applies_above`` is
    the request path's rule for the least ``max_tokens`` a budget applies to (for the journal)."""

    def __init__(
        self, settings: PaceSettings, *, lo: int, hi: int, headroom: int, applies_above: Callable[[int], int]
    ) -> None:
        self.settings = settings
        self._band = (lo, hi, headroom)
        self._applies_above = applies_above
        self._paces: dict[str, Pace] = {}

    def backed_off_at(self, worker_id: str) -> float:
        """When the worker's limit last backed off: the time to first token is read from requests sent after."""
        return self._paces.get(worker_id, Pace()).backed_off_at

    def decide(self, worker_id: str, sample: Sample, load: LoadReading) -> FastDecision:
        lo, hi, headroom = self._band
        kv_peak_share, batch_request_share = _shares(load, sample.max_total_tokens)
        look = PaceInput(
            time=sample.time,
            running=sample.running,
            queue=sample.queue,
            token_usage=sample.token_usage,
            retractions_total=sample.retractions_total,
            generation_tokens_total=sample.generation_tokens_total,
            in_flight=load.in_flight,
            backlog=load.backlog,
            mean_output_tokens=load.mean_output_tokens,
            ttft_s=load.ttft_s,
            interactive_output_tokens=load.interactive_output_tokens,
            interactive_waiting=load.interactive_waiting,
            step_s=load.step_s,
            kv_peak_share=kv_peak_share,
            batch_request_share=batch_request_share,
            batch_in_flight=load.batch_in_flight,
            admission_share=load.admission_share,
            batch_admission_share=load.batch_admission_share,
        )
        prev = self._paces.get(worker_id, Pace())
        pace = next_pace(prev, look, lo=lo, hi=hi, headroom=headroom, settings=self.settings)
        self._paces[worker_id] = pace
        moves, evidence = self.budgets(load.budgets)
        limit, held = held_open(pace.limit, load.held_open)
        return FastDecision(
            time=sample.time,
            limit=limit,
            queue_target=pace.queue_target,
            batch_queue_target=pace.batch_queue_target,
            batch_limit=pace.batch_limit,
            first_token_wait_s=pace.first_token_wait_s,
            take_back_batch=pace.take_back_batch,
            kv_peak_share=kv_peak_share,
            budgets=moves,
            evidence=evidence,
            reason=pace.reason if held is None else held,
        )

    def budgets(self, readings: Sequence[BudgetReading]) -> tuple[tuple[BudgetMove, ...], tuple[OutputBudget, ...]]:
        """Each budget's next value: lifted when its answers overran it, else read from its cohort's
        answers (too few to say: it stands, a class's first answers set it); and the journal's evidence."""
        settings = self.settings
        moves: list[BudgetMove] = []
        evidence: list[OutputBudget] = []
        for r in readings:
            overrun = r.current is not None and budget_overrun(r.reached, r.ended_within, settings)
            if overrun:
                new = None
            else:
                new = output_budget(r.written, settings) or (r.current if settings.output_budget else None)
            moves.append(BudgetMove(interactive=r.interactive, asked=r.asked, tokens=new, overrun=overrun))
            if budget_moved(r.current, new, settings):
                above = None if new is None else self._applies_above(new)
                lifted_by = (r.reached, r.ended_within) if overrun else None
                note = budget_evidence(
                    r.written, r.interactive, r.asked, r.current, new, settings, above, overrun=lifted_by
                )
                before = None if r.current is None else self._applies_above(r.current)
                evidence.append(replace(note, previous_applies_above_tokens=before))
        return tuple(moves), tuple(evidence)


def _shares(load: LoadReading, pool_tokens: int | None) -> tuple[float | None, float | None]:
    """The KV ahead (the open batch's peak plus the open interactive requests' whole size: as those
    end, the next ones need that much free) and a batch request's whole size, as shares of the pool."""
    if load.open_batch is None or not pool_tokens:
        return None, None
    chat = sum(held + left for held, left in load.open_interactive)
    kv_peak_share = (kv_peak(load.open_batch) + chat) / pool_tokens
    if not load.open_batch:
        return kv_peak_share, None
    batch_request_share = sum(held + left for held, left in load.open_batch) / len(load.open_batch) / pool_tokens
    return kv_peak_share, batch_request_share
