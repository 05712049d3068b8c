"""The worker's queue on one side of its engine's prefix limit: free ``fcfs`` for an ``lpm`` worker.

SGLang's ``lpm`` matches every waiting request's prefix each scheduling round, and stops doing so
(serving the queue in arrival order) once more than 128 wait. The proxy's gate decides how many wait
there. At the limit, every round is ordered by prefix: what shared prompts gain. Past it, none is:
no matching cost, as ``fcfs`` with no restart. Across it, the engine switches from one round to the
next and pays the matching without its gain, so the gate keeps one side (``WorkerLoad.queue_sides``):
at the limit until a look of the planner's twin prices the queue past it a gain, and back where a look
prices it a loss (:func:`price_queue`). Shared prompts keep ``lpm`` at work; unique ones get ``fcfs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.control.hold import hold_loses, hold_pays
from proxy.control.twin import Prediction, Twin
from proxy.control.workload import Observed, Replay

__all__ = ["QueuePrice", "may_share", "price_queue"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuePrice:
    """The twin's worker with its queue kept at ``at`` (the engine's prefix limit) and ``past`` it: whether
    past pays, loses, or (neither) lies inside the twin's noise."""

    at: int
    past: int
    at_limit: Prediction
    past_limit: Prediction
    pays: bool
    loses: bool

    def kept(self, twin: Twin) -> tuple[Twin, Prediction]:
        """The twin with the queue the gate keeps after this look (past where it pays, at where it loses,
        else the one it keeps now: ``twin``'s), and its prediction."""
        past = self.pays or (twin.queue_cap == self.past and not self.loses)
        depth, prediction = (self.past, self.past_limit) if past else (self.at, self.at_limit)
        return replace(twin, queue_cap=depth), prediction


def may_share(loaded: Replay, sample: Sequence[Observed]) -> bool:
    """Whether a look's requests may share prefixes for lpm to order by: its replay carries a shared
    head, or the engine does not report its cached tokens (its replay then shows none, whatever there is)."""
    return any(sp.shared is not None for sp in loaded.specs) or all(o.cached_tokens is None for o in sample)


def price_queue(
    twin: Twin,
    args: Mapping[str, object],
    loaded: Replay,
    current: Prediction,
    sides: tuple[int, int] | None,
    min_gain: float,
    *,
    error: float | None = None,
    backlog: bool = False,
    sharing: bool = True,
) -> QueuePrice | None:
    """Both sides on the look's replay (``loaded``; ``current``: the twin under ``args`` with the gate's
    queue now, one of the sides; ``backlog``: throughput alone counts), weighed as the hold is
    (:func:`~proxy.control.hold.hold_pays`); None where the gate has no sides (``sides``) or the replay failed.
    Past the limit is the move away from what the operator chose (lpm at work): it pays only by more
    than the twin's ``error`` too, as a restart must (prefix-shared's first look, on a few answers,
    priced it 4 % sooner and the next a 6 % loss); back at the limit needs only ``min_gain``. Where the
    look's requests share nothing (``sharing`` False: no two requests the proxy holds carry one prefix,
    the engine reports its cached tokens and no two answers share a cached head), lpm has nothing to
    order by and past it only saves the matching: past, unless the twin prices it fewer tokens (a
    replay whose queue never reaches the limit prices both sides alike; answer times move with the
    tokens there, and one look priced 29 % more tokens answered later)."""
    if sides is None or current.oom:
        return None
    at, past = sides
    at_limit, past_limit = (
        current if twin.queue_cap == depth else replace(twin, queue_cap=depth).predict(args, loaded) for depth in sides
    )
    if at_limit.oom or past_limit.oom:
        return None
    loses = hold_loses(past_limit, at_limit, min_gain, backlog=backlog or not sharing)
    pays = hold_pays(past_limit, at_limit, max(min_gain, error or 0.0), backlog=backlog) if sharing else not loses
    return QueuePrice(at=at, past=past, at_limit=at_limit, past_limit=past_limit, pays=pays, loses=loses)
