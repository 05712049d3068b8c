"""A worker against the rest of its pool: the gain of the arguments its peers run, as measured.

The twin replays a worker's own traffic, which the proxy's gate sent at the pace the worker served it.
A worker that could serve more would be sent more, from the other workers' share; that replay cannot
show it (the fleet scenario's worker capped at 64 running read +0.2 % on its own traffic while its
peers served 1.45 times as much). Where the whole pool is backlogged, each worker's output rate is its
capacity, so a worker that trails peers on the same GPU, model and placement, which differ from it
only in the arguments the planner tunes, would gain what they gain: :func:`peer_candidate`. The
planner weighs it like any candidate; the canary judges it on the same share afterwards.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PeerCandidate", "PeerLoad", "peer_candidate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLoad:
    """One serving worker of a pool, as the comparison reads it."""

    worker_id: str
    args: Mapping[str, object]
    hardware: tuple[str, str]  # its GPU and model, as its twin names them
    rate: float | None  # output tokens/s over its window, as decoded (None: not measured)
    busy: float  # the share of that window work waited for it (or its KV pool was full)

    def at_capacity(self, slack: float) -> bool:
        """Work waited for it over all but ``slack`` of the window its rate is over: the rate is within
        about that much of what it can do."""
        return self.rate is not None and self.rate > 0 and self.busy >= 1.0 - slack


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCandidate:
    """The arguments peers run, and what they serve over what this worker serves."""

    args: Mapping[str, object]
    peers: tuple[str, ...]
    own_rate: float
    peers_rate: float  # their mean
    spread: float  # their relative standard deviation (0: one peer): a gain inside it is noise

    @property
    def gain(self) -> float:
        return self.peers_rate / self.own_rate - 1.0


def _rest(args: Mapping[str, object], tuned: Collection[str]) -> dict[str, object]:
    return {k: v for k, v in args.items() if k not in tuned}


def peer_candidate(
    own: PeerLoad, others: Sequence[PeerLoad], tuned: Collection[str], slack: float
) -> PeerCandidate | None:
    """The best-serving group of ``own``'s peers that run other values of the ``tuned`` arguments, the
    rest alike, where all of them and ``own`` are at capacity (idle at most ``slack`` of their windows:
    the planner's noise floor) and the group serves more than ``own`` by more than its own spread; None
    where there is no such group."""
    if not own.at_capacity(slack) or own.rate is None:
        return None
    rest = _rest(own.args, tuned)
    groups: dict[tuple[tuple[str, str], ...], list[PeerLoad]] = {}
    for p in others:
        if p.hardware != own.hardware or _rest(p.args, tuned) != rest or dict(p.args) == dict(own.args):
            continue
        if not p.at_capacity(slack):
            return None  # one of them serves what it is sent: the pool's rates are not its capacities
        key = tuple(sorted((k, repr(v)) for k, v in p.args.items()))
        groups.setdefault(key, []).append(p)
    best: PeerCandidate | None = None
    for group in groups.values():
        rates = [p.rate for p in group if p.rate is not None]
        mean = statistics.fmean(rates)
        spread = statistics.stdev(rates) / mean if len(rates) > 1 else 0.0
        found = PeerCandidate(args=dict(group[0].args), peers=tuple(p.worker_id for p in group), own_rate=own.rate,
                              peers_rate=mean, spread=spread)  # fmt: skip
        if found.gain > spread and (best is None or found.peers_rate > best.peers_rate):
            best = found
    return best
