"""A plan's verdict: whether a restart pays, in numbers and a why-code, before any words.

:func:`verdict` replays the candidates (:mod:`proxy.control.candidates`), chooses the one with the best
mean gain over this look and the earlier looks that said a restart pays (with the band's larger KV
pool where the twin cannot tell it worse), weighs its gain over the horizon against the restart's
cost (:mod:`proxy.control.economics`), holds back a gain inside the twin's error, and where no
throughput gain pays asks the waiting basis (:mod:`proxy.control.waiting`). The result is a
:class:`Verdict` of numbers and a :class:`Why`; its reason in words is written apart
(:mod:`proxy.control.explain`), so that wording never moves a decision.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.control.candidates import Replayed, args_key, replay_candidates, roomier_pool
from proxy.control.economics import PlanSettings, RestartCost, no_worse, twin_error
from proxy.control.hold import HoldPrice, price_hold
from proxy.control.peers import PeerCandidate
from proxy.control.queue_side import QueuePrice, may_share, price_queue
from proxy.control.twin import Prediction, Twin
from proxy.control.waiting import WaitingPlan, waiting_basis
from proxy.control.workload import InFlight, Observed, measured_throughput

__all__ = ["Verdict", "Why", "verdict"]


class Why(enum.Enum):
    """What a plan's verdict rests on (its reason says it in words: :func:`~proxy.control.explain.explain`)."""

    NO_BETTER = "no candidate beats the current arguments"
    UNTRUSTED = "the gain would pay, but is inside the twin's error"
    NOTHING_WAITS = "nothing waits for the worker: a throughput gain does not accrue"
    DOES_NOT_PAY = "the gain over the horizon does not pay the restart"
    PAYS = "the throughput gain pays the restart"
    WAITING_PAYS = "the waiting saved pays the restart"


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A plan's numbers and choice, before any words (:func:`verdict`)."""

    why: Why
    current: Prediction
    best: Prediction  # the throughput basis's choice (``current`` when none beats it)
    base: float  # the current args' output tokens/s going on
    gain: float  # best's over base, the mean over the paying looks, with the larger pool's
    weighed: float  # base x (1 + gain): what the restart is weighed on
    paying_looks: int  # the looks the gain is a mean over
    this_look_gain: float  # best's gain on this look alone
    roomier_behind: float | None  # the larger pool taken though the twin puts it this far behind (None: not)
    accrues_s: float
    gain_tokens: float
    cost_tokens: float
    measured: float | None  # what the worker did on the replayed requests
    now_error: float | None  # the twin's error on this look
    error: float | None  # its error over the looks under the same args
    pays: bool
    trusted: bool
    waiting: WaitingPlan | None  # the waiting basis's candidate, when one was weighed
    gains: Mapping[str, float]
    savings: Mapping[str, float]
    refused: tuple[Prediction, ...]
    replays: int
    hold: HoldPrice | None = None  # holding the worker at its CUDA graphs' batch, no restart (None: not priced)
    queue: QueuePrice | None = None  # its queue past its engine's prefix limit, no restart (None: not priced)
    peer: PeerCandidate | None = None  # ``best`` is the peers' arguments, its gain measured on them (None: not)


@dataclass(frozen=True, slots=True)
class _Choice:
    """The throughput basis's candidate: ``best`` (``current``: none), its gain and how it was read."""

    best: Prediction
    gain: float
    paying_looks: int
    roomier_behind: float | None
    replays: int
    peer: PeerCandidate | None = None  # ``best`` is the peers' arguments, at the gain measured on them


def _choose(
    twin: Twin,
    r: Replayed,
    gains: Mapping[str, float],
    earlier_gains: Sequence[Mapping[str, float]],
    settings: PlanSettings,
) -> _Choice:
    """The candidate with the best mean gain over this look and the earlier paying looks that replayed
    it; a restart for it takes the KV pool the band's floor allows too, unless the twin puts that one
    worse by more than it can tell."""
    base = r.current.output_tok_per_s

    def over_looks(p: Prediction) -> float:
        key = args_key(p.args)
        return statistics.fmean([gains[key], *(g[key] for g in earlier_gains if key in g)])

    best, gain = r.current, 0.0
    for p in r.served:
        if (mean := over_looks(p)) > max(gain, 0.001):
            best, gain = p, mean
    if best is r.current:
        return _Choice(best, gain, 1, None, 0)
    paying_looks = 1 + sum(1 for g in earlier_gains if args_key(best.args) in g)
    peer = settings.peer
    if peer is not None and args_key(best.args) == args_key(peer.args):  # measured on the peers as they run:
        return _Choice(best, gain, paying_looks, None, 0, peer)  # the twin's larger pool is not that
    roomier = roomier_pool(twin, best, r.loaded, settings)
    behind = None
    if roomier is not None and no_worse(roomier.output_tok_per_s, best.output_tok_per_s, settings):
        if roomier.output_tok_per_s < best.output_tok_per_s:
            behind = roomier.output_tok_per_s / best.output_tok_per_s - 1.0
        gain += max(0.0, roomier.output_tok_per_s - best.output_tok_per_s) / base
        best = roomier
    return _Choice(best, gain, paying_looks, behind, int(roomier is not None))


def _measured_on_peers(r: Replayed, peer: PeerCandidate | None) -> Replayed:
    """``r`` with the peers' arguments (where the twin served them) at the gain measured on the peers: the
    twin replays this worker's own traffic, which the gate sent at its pace, and cannot show a worker
    that would be sent more (:mod:`proxy.control.peers`)."""
    if peer is None:
        return r
    key, base = args_key(peer.args), r.current.output_tok_per_s
    served = [replace(p, output_tok_per_s=base * (1.0 + peer.gain)) if args_key(p.args) == key else p for p in r.served]
    return replace(r, served=served)


def verdict(
    twin: Twin,
    args: Mapping[str, object],
    workload: Sequence[Observed],
    cost: RestartCost,
    settings: PlanSettings,
    resolved: Mapping[str, float] | None = None,
    in_flight: Sequence[InFlight] = (),
    now: float | None = None,
    earlier_errors: Sequence[float] = (),
    earlier_gains: Sequence[Mapping[str, float]] = (),
    earlier_savings: Sequence[Mapping[str, float]] = (),
) -> Verdict:
    """:func:`~proxy.control.planner.plan`'s numbers and choice, without words."""
    r = _measured_on_peers(replay_candidates(twin, args, workload, settings, resolved, in_flight, now), settings.peer)
    current, base = r.current, r.current.output_tok_per_s
    gains = {args_key(p.args): p.output_tok_per_s / base - 1.0 for p in r.served} if base > 0 else {}
    choice = _choose(twin, r, gains, earlier_gains, settings)
    best, gain = choice.best, choice.gain
    weighed = base * (1.0 + gain)
    accrues_s = settings.horizon_s if settings.work_waits_s is None else min(settings.horizon_s, settings.work_waits_s)
    gain_tokens, cost_tokens = (weighed - base) * accrues_s, cost.tokens(base)
    measured = r.loaded.measured() or measured_throughput(r.sample)
    predicted = current.answered_tok_per_s
    # how far the twin is from what the worker did on the same requests: a gain inside that is not one
    # (a sample without answer times says nothing of it: the twin's own figures stand)
    now_error = abs(predicted - measured) / measured if measured and predicted is not None else None
    error = twin_error(earlier_errors, now_error)
    trusted = error is None or gain > error
    pays = best is not current and gain >= settings.min_gain and gain_tokens > cost_tokens
    waiting: WaitingPlan | None = None
    savings: dict[str, float] = {}
    waiting_replays = 0
    if not (pays or settings.backlog):
        waiting, savings, waiting_replays = waiting_basis(twin, r, len(in_flight), cost, settings, earlier_savings)
    if waiting is not None and waiting.saved_s > waiting.cost_s:
        why = Why.WAITING_PAYS
    elif best is current:
        why = Why.NO_BETTER
    elif pays and not trusted:
        why = Why.UNTRUSTED
    elif accrues_s <= 0:
        why = Why.NOTHING_WAITS
    else:
        why = Why.PAYS if pays else Why.DOES_NOT_PAY
    this_look = best.output_tok_per_s / base - 1.0 if base > 0 else 0.0
    queue = price_queue(twin, args, r.loaded, current, settings.queue_sides, settings.min_gain, error=error,
                        backlog=settings.backlog,
                        sharing=settings.prefixes_shared or may_share(r.loaded, r.sample))  # fmt: skip
    # the hold is priced against the queue the gate keeps after this look: holding the open requests at
    # the graphs' batch leaves next to nothing waiting at the engine, whichever side of lpm's limit
    gate, kept = (twin, current) if queue is None else queue.kept(twin)
    hold = price_hold(gate, args, r.loaded, kept, settings.min_gain, backlog=settings.backlog)
    queue_replays = 0 if queue is None else sum(p is not current for p in (queue.at_limit, queue.past_limit))
    return Verdict(hold=hold, queue=queue, peer=choice.peer, why=why, current=current, best=best, base=base, gain=gain, weighed=weighed,
                   paying_looks=choice.paying_looks, this_look_gain=this_look, roomier_behind=choice.roomier_behind,
                   accrues_s=accrues_s, gain_tokens=gain_tokens, cost_tokens=cost_tokens, measured=measured,
                   now_error=now_error, error=error, pays=pays, trusted=trusted, waiting=waiting, gains=gains,
                   savings=savings, refused=r.refused,
                   replays=r.replays + choice.replays + waiting_replays + (hold is not None) + queue_replays)  # fmt: skip
