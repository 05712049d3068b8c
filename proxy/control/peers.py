"""A worker against the rest of its pool: the gain of the arguments its peers run, as measured.

The twin replays a worker's own traffic, which the proxy's gate sent at the pace the worker served it.
A worker that could serve more would be sent more, from the other workers' share; that replay cannot
show it (the fleet scenario's worker capped at 64 running read +0.2 % on its own traffic while its
peers served 1.45 times as much). A worker's output rate is at most its capacity, and at least its
capacity times the share of the time work waited for it. So a worker that trails peers on the same
GPU, model and placement, which differ from it only in the arguments the planner tunes, gains at
least their rate over its rate, discounted by its own idle share: :func:`peer_candidate`. The planner
weighs it like any candidate; the canary judges it on the same share afterwards.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCandidate:
    """The arguments peers run, and what they serve over what this worker serves."""

    args: Mapping[str, object]
    peers: tuple[str, ...]
    own_rate: float
    own_busy: float  # the share of its window work waited for this worker
    peers_rate: float  # their mean
    spread: float  # their relative standard deviation (0: one peer): a gain inside it is noise

    @property
    def gain(self) -> float:
        """The least gain the rates allow: this worker's capacity is at most its rate over its busy share."""
        return self.own_busy * self.peers_rate / self.own_rate - 1.0


def _rest(args: Mapping[str, object], tuned: Collection[str]) -> dict[str, object]:
    return {k: v for k, v in args.items() if k not in tuned}


def peer_candidate(own: PeerLoad, others: Sequence[PeerLoad], tuned: Collection[str]) -> PeerCandidate | None:
    """The best-serving group of ``own``'s peers that run other values of the ``tuned`` arguments, the
    rest alike, whose rate over ``own``'s gains more than the group's own spread (see the module
    docstring); None where there is no such group. A peer's idle time only lowers the gain."""
    if own.rate is None or own.rate <= 0 or own.busy <= 0:
        return None
    rest = _rest(own.args, tuned)
    groups: dict[tuple[tuple[str, str], ...], list[PeerLoad]] = {}
    for p in others:
        if (
            p.rate is None
            or p.hardware != own.hardware
            or _rest(p.args, tuned) != rest
            or dict(p.args) == dict(own.args)
        ):
            continue
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in p.args.items())), []).append(p)
    best: PeerCandidate | None = None
    for group in groups.values():
        rates = [p.rate for p in group if p.rate is not None]
        mean = statistics.fmean(rates)
        spread = statistics.stdev(rates) / mean if len(rates) > 1 else 0.0
        found = PeerCandidate(args=dict(group[0].args), peers=tuple(p.worker_id for p in group), own_rate=own.rate,
                              own_busy=own.busy, peers_rate=mean, spread=spread)  # fmt: skip
        if found.gain > spread and (best is None or found.peers_rate > best.peers_rate):
            best = found
    return best
