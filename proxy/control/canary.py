"""Canary: with two or more workers, new arguments go to one worker first.

A planner's decision (or an operator's trial, ``POST /admin/trial``) restarts one worker (the
canary) with the new arguments; the others keep theirs. After a window (``window_s`` of evidence
on the canary) :func:`judge` compares the canary with the other workers, who served the same
traffic over the same time. The evidence begins once the canary has refilled, as the planner
expects it to (its plan's refill and recomputed work; none for an operator's trial): a worker that
has just restarted serves its first seconds from an empty batch, and read then it looks worse than
its arguments are.

The figure is each worker's **share**: its output tokens per second over the window divided by
the other workers' mean (:func:`share`), taken twice: just before the canary's restart
(``before``) and over its window (``after``). The verdict reads the change of that share:

* ``promote`` when the canary now beats the others by ``margin`` (``after > 1 + margin``) and
  gained on its own standing (``after > before x (1 + margin)``), and by enough to pay each of the
  others a restart of its own (``pays_above``: a planner's canary, where its plan priced a restart
  of this worker; see :func:`pays_above`): the others are restarted with its arguments, one at a
  time;
* ``keep`` when it gained on its own standing but only caught up with the others (a worker started
  with bad arguments, fixed), or beat them by less than a restart of each would pay back: it keeps
  its new arguments, the others keep theirs (their own plans may still move them);
* ``revert`` otherwise (or when it died): the canary is restarted with its old arguments. A canary
  whose share fell under ``canary_fail_below`` x its share before (:func:`failing`) is reverted as
  soon as ``min_evidence_s`` of it is in, without waiting for the whole window.

Why total throughput and not throughput per running request: a worker capped to a few running
requests decodes each of them fast, so per running request it looks far better than the others
while it serves a fraction of their tokens. The dispatcher sends each worker what it can take
(pacing by its own server queue), so when the pool has work waiting every worker's throughput is
its capacity, and the share compares capacities directly; a candidate that turns traffic away
(a cap, a smaller KV pool) serves a smaller share. When the pool is not backlogged each worker
serves what arrives for it, the share stays near its old value whatever the arguments, and the
verdict is ``revert``: a restart is promoted only on a measured gain. Comparing the share before
and after (rather than the canary alone against its own past) takes out what changed for the
whole pool meanwhile (the traffic's rate or mix).

Restarts roll one worker at a time (the controller starts no act while another worker is
restarting or down), so at least (N-1)/N of the fleet serves throughout. Pure: figures in, verdict out.
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
