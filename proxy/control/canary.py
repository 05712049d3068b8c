"""Canary: with two or more workers, new arguments go to one worker first.

A planner's decision (or an operator's trial, ``POST /admin/trial``) restarts one worker, the
canary, with the new arguments; the others keep theirs. Once the canary has refilled and
``window_s`` of evidence is in, :func:`judge` compares it with the other workers, who served the
same traffic over the same time.

The figure is each worker's **share** (:func:`share`): its output tokens per second over the
other workers' mean, taken before the restart and over the window. ``promote`` (restart the others
with its arguments, one at a time) when the canary beats the others by ``margin``, gained on its
own standing, and gained enough to pay a restart of each (:func:`pays_above`); ``keep`` when it
gained but by less; ``revert`` otherwise, early when :func:`failing` says so.

Total throughput, not throughput per running request: a worker capped to a few requests decodes
each fast while serving a fraction of the tokens. When the pool is backlogged every worker's
throughput is its capacity, so the share compares capacities; comparing the share before and after
takes out what changed for the whole pool. Restarts roll one worker at a time, so at least (N-1)/N
of the fleet serves throughout. Pure: figures in, verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Canary", "CanaryVerdict", "failing", "judge", "pays_above", "share"]


class CanaryVerdict(StrEnum):
    PROMOTE = "promote"  # roll the canary's arguments out to the others
    KEEP = "keep"  # the canary keeps its arguments; the others keep theirs
    REVERT = "revert"  # the canary gets its old arguments back
    WAIT = "wait"  # not measured yet


@dataclass(frozen=True, slots=True, kw_only=True)
class Canary:
    worker_id: str
    entry_id: int  # the journal entry of the decision it tries
    old_args: Mapping[str, object]
    new_args: Mapping[str, object]
    before: float | None = None  # its share of the others' throughput just before its restart (None: not measured)
    # when its evidence begins: ready, plus the refill its plan expects (None: not serving with the new args
    # yet); judged window_s later, or earlier if it is clearly failing
    opens: float | None = None
    # the share above which a restart of each other worker pays (:func:`pays_above`; None: an operator's
    # trial, promoted on the margin alone)
    promote_above: float | None = None


def pays_above(cost_tokens: float, throughput: float, horizon_s: float) -> float | None:
    """The share of the others' throughput above which rolling a canary's arguments out pays: each
    other worker gains ``share - 1`` of its throughput over the horizon, and its restart costs about
    what the canary's plan priced one at (``cost_tokens`` at the canary's ``throughput`` before it), so
    ``1 + cost_tokens / (throughput x horizon_s)``. The planner restarts a worker only where the gain
    over the horizon pays the restart, and a promotion is N-1 restarts: with the margin alone, a
    canary 4 % ahead of the others over one window rolled out to three workers whose restarts each
    cost about 5 % of a horizon's output. None: nothing to price it with."""
    if throughput <= 0 or horizon_s <= 0 or cost_tokens < 0:
        return None
    return 1.0 + cost_tokens / (throughput * horizon_s)


def share(mine: float | None, others: Sequence[float | None]) -> float | None:
    """A worker's output tokens/s over the mean of the other workers' (None: not measured)."""
    seen = [o for o in others if o is not None]
    if mine is None or not seen:
        return None
    mean = sum(seen) / len(seen)
    return mine / mean if mean > 0 else None


def failing(after: float | None, before: float | None, below: float) -> bool:
    """A canary clearly worse than it was: its share fell under ``below`` x its share before (1 when
    not measured). Reverted as soon as there is evidence (``min_evidence_s``), not after the whole
    window: what a clearly bad candidate costs grows with every second it serves (``below`` 0: never)."""
    if after is None or below <= 0:
        return False
    return after < below * (1.0 if before is None else before)


def judge(
    after: float | None, before: float | None, margin: float, promote_above: float | None = None
) -> CanaryVerdict:
    """The verdict on a canary whose share of the others' throughput went from ``before`` (None:
    not measured; taken as 1, an equal) to ``after``; promoted only above ``promote_above`` too (None:
    on the margin alone)."""
    if after is None:
        return CanaryVerdict.WAIT
    baseline = 1.0 if before is None else before
    if after <= baseline * (1.0 + margin):
        return CanaryVerdict.REVERT
    beats = after > max(1.0 + margin, promote_above or 0.0)
    return CanaryVerdict.PROMOTE if beats else CanaryVerdict.KEEP
