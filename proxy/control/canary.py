"""Canary: with two or more workers, new arguments go to one worker first.

The planner's decision restarts one worker (the canary) with the new arguments; the others keep
theirs. After a window (``window_s`` of evidence on the canary) :func:`judge` compares the canary's
throughput per unit of request load (output tokens/s over the mean running batch: how well it
serves what it holds, whatever share of the traffic it got) with the other workers' mean:

* ``promote`` when the canary beats them by ``margin``: the others are restarted with its
  arguments, one at a time;
* ``revert`` otherwise (or when it died): the canary is restarted with its old arguments.

Restarts roll one worker at a time (the controller starts no act while another worker is
restarting or down), so at least (N-1)/N of the fleet serves throughout. Pure: figures in, verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Canary", "CanaryVerdict", "judge", "per_load"]


class CanaryVerdict(StrEnum):
    PROMOTE = "promote"
    REVERT = "revert"
    WAIT = "wait"


@dataclass(frozen=True, slots=True, kw_only=True)
class Canary:
    worker_id: str
    entry_id: int  # the journal entry of the decision it tries
    old_args: Mapping[str, object]
    new_args: Mapping[str, object]
    due: float | None = None  # when to judge (None: not serving with the new args yet)


def per_load(throughput: float | None, mean_running: float | None) -> float | None:
    """Output tokens/s per running request (None: not measured)."""
    if throughput is None or not mean_running or mean_running <= 0:
        return None
    return throughput / mean_running


def judge(canary: float | None, others: Sequence[float | None], margin: float) -> CanaryVerdict:
    """Promote when the canary's throughput per load beats the others' mean by ``margin``."""
    seen = [o for o in others if o is not None]
    if canary is None or not seen:
        return CanaryVerdict.WAIT
    baseline = sum(seen) / len(seen)
    return CanaryVerdict.PROMOTE if canary > baseline * (1.0 + margin) else CanaryVerdict.REVERT
