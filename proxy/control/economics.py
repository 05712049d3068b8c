"""The terms a restart is weighed in: the plan's settings, what a restart costs, how far the twin is off.

:class:`PlanSettings` bounds the candidates and says how long a gain accrues; :class:`RestartCost` is
a restart's price as measured on the worker (start-up, drain, work taken back and computed again), in
tokens on the throughput basis and in seconds of outage on the waiting basis, where
:func:`outage_waiting_s` turns the outage into request-seconds of waiting. :func:`twin_error` is how
far the twin is from the worker over its recent looks (a gain inside it says neither way), and
:func:`no_worse` the noise floor within which a larger KV pool is taken. Numbers only, no replay.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.control.peers import PeerCandidate

__all__ = [
    "ERROR_LOOKS",
    "RUNNING_SAMPLES",
    "PlanSettings",
    "RestartCost",
    "no_worse",
    "outage_waiting_s",
    "replayed_requests",
    "twin_error",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSettings:
    horizon_s: float = 600.0  # how long the traffic just seen is expected to last
    # the work waiting outlasts the configured horizon (its age and its drain: the horizon is the
    # backlog's): the worker is busy throughout, throughput-bound, and the waiting basis is not asked
    backlog: bool = False
    # how long work is expected to wait for the worker, where the traffic says it is less than the
    # horizon: 0 where nothing waits at this look (no backlog: it has caught up with what arrives), the
    # backlog's remainder where the work it holds falls for sure (None: the whole horizon). A throughput
    # gain accrues only while work waits (a replay that goes on sends the sample again, so a batch
    # submitted at once and being answered reads as more of it to come)
    work_waits_s: float | None = None
    # requests waiting for the worker in the proxy's own queue at the look (its share among the workers
    # serving: the others take it while this one is out): each waits a restart's outage out, as those
    # open on the worker do (mixed's batch, held back beside the chat, is not on the worker)
    queued: float = 0.0
    max_requests: int = 300  # the replayed sample: the newest this many requests
    max_candidates: int = 10
    # a predicted gain below this is noise, whatever the horizon (and a loss below it: see no_worse)
    min_gain: float = 0.03
    conservativeness: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3)
    conservativeness_bounds: tuple[float, float] = (0.1, 2.0)
    memory_fraction_step: float = 0.01  # the controller passes its constants' memory_fraction_step
    memory_fraction_bounds: tuple[float, float] = (0.5, 0.95)
    min_available_gb: float = 5.0  # free memory at start-up below this: not a candidate (the band's floor)
    # the twin's activations are the worker's (its KV pool is the one the worker reported): a candidate's
    # floor is what its activations need (:func:`~proxy.control.candidates.free_floor_gb`), not the band's
    activations_known: bool = False
    max_available_gb: float | None = None  # the band's top: more free than this is a KV pool left unused
    # the tuning guide's schedule policy and CUDA-graph batch size are candidates too (where the engine
    # has them: :func:`~proxy.control.candidates.lever_candidates`)
    levers: bool = True
    graph_max_bs_bounds: tuple[float, float] = (1.0, float("inf"))  # the CUDA graphs' batch size may move in
    # the proxy's queue target for the worker (its gate keeps about this many waiting there): the twin's
    # replays wait in front of its engine beyond it (None: not known, all at the engine)
    engine_queue: int | None = None
    gate_period_s: float = 0.0  # how often the gate looks (the scrape period, engine seconds)
    prefix_first: int = 0  # the proxy's queue order (:meth:`~proxy.control.ports.Surroundings.prefix_first`)
    # the gate's queue at and past the engine's prefix limit, one of them ``engine_queue``
    # (:mod:`proxy.control.queue_side`; None: the engine has no such limit)
    queue_sides: tuple[int, int] | None = None
    # two requests the proxy holds for the pool carry the same prompt prefix (the proxy's own view, from
    # the first request on: a look's answers may not show a group's shared head cached yet)
    prefixes_shared: bool = True
    # the arguments the worker's peers run and the least gain their rates allow over it
    # (:func:`~proxy.control.peers.peer_candidate`; None: no such peers)
    peer: PeerCandidate | None = None


RUNNING_SAMPLES = 2  # the running batch and as many again arriving behind it


def replayed_requests(base: int, peak_running: int | None) -> int:
    """How many of the newest answers a plan replays: ``base``, or twice the largest batch the worker
    ran where that is more. A replay of fewer requests than the worker ran at once never fills the
    batch the worker ran: the twin is then judged, and prices candidates, on another engine's load."""
    return max(base, RUNNING_SAMPLES * int(peak_running or 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartCost:
    """What one restart of this worker costs, as measured on it.

    What was in flight is computed again: the output it had written is decoded again (a whole answer
    taken back starts over), at the worker's decode pace, and its prompts are prefilled again, which
    a GPU does many times faster than it decodes: ``refill_s``, the twin's prefill time for them on
    the worker's calibrated clock (:func:`~proxy.control.planner.run_plan`). A first build counted the prompts as output
    tokens, at the decode pace: in retraction-storm's hour, 180,000 tokens of cost where a restart in
    the replay costs 113,000."""

    startup_s: float | None  # its last start, launch to ready, as the proxy saw it (None: not seen yet)
    drain_s: float = 0.0  # the last drain before a restart (0: none seen yet)
    recomputed_tokens: float = 0.0  # output written by what was in flight: decoded again after the restart
    refill_prompt_tokens: float = 0.0  # the prompts of what was in flight: prefilled again
    refill_requests: int = 0  # how many requests those prompts are
    refill_s: float = 0.0  # the time to prefill them again (the twin's, set by run_plan)

    def tokens(self, throughput: float) -> float:
        """Output tokens the restart costs at ``throughput`` tokens/s."""
        return throughput * ((self.startup_s or 0.0) + self.drain_s + self.refill_s) + self.recomputed_tokens

    def outage_s(self, throughput: float) -> float:
        """Seconds of the worker's service the restart takes: the drain, the start-up and the time to
        compute again what was in flight, at ``throughput`` tokens/s."""
        recompute = self.recomputed_tokens / throughput if throughput > 0 else 0.0
        return (self.startup_s or 0.0) + self.drain_s + self.refill_s + recompute


ERROR_LOOKS = 5  # the twin's error on a worker: the median over this many looks under the same args


def twin_error(earlier: Sequence[float], now: float | None) -> float | None:
    """How far the twin is from the worker under its current args: the median of its error on this look
    (``now``; None: the look had nothing to measure) and on the ``ERROR_LOOKS - 1`` looks before it
    (``earlier``, newest last). One look measures the worker on the few dozen long answers that ended in
    its window, and which of them did moves the figure more than the twin does: in two of
    retraction-storm's hours the looks at one worker under one set of args read 1.3-11.1 %, and a
    restart whose gain (5-9 %) stood above the twin's usual error waited out runs of three and four
    looks that read high, about 500 modelled seconds each time."""
    found = [*earlier[-(ERROR_LOOKS - 1) :], *(() if now is None else (now,))]
    return statistics.median(found) if found else None


def no_worse(larger_pool: float, without: float, settings: PlanSettings) -> bool:
    """Whether the twin's figure for a candidate with the band's larger KV pool (tokens/s, or for the
    waiting basis the inverse: pass the answer times swapped) loses no more than the planner's noise
    floor (``min_gain``) against the same candidate without it. A restart takes the larger pool then:
    the band says where the pool belongs, and a few hundred replayed requests cannot tell a pool 2 %
    larger from the one it has (in three of nine retraction-storm hours the twin put 0.85, the best
    static arguments' fraction, a little below the restart's candidate on the window's requests, and the
    restart went without it; in a backlog of the same requests it is 1-6 % ahead)."""
    return larger_pool >= without * (1.0 - settings.min_gain)


def outage_waiting_s(waiting: float, rate: float, outage_s: float, utilization: float | None) -> float:
    """Request-seconds of waiting an outage of ``outage_s`` adds on a worker that answers what arrives
    at ``rate`` requests/s at ``utilization`` (the work arriving over what the worker can do, 0-1): the
    ``waiting`` requests (open on it, or held for it in the proxy's queue) wait the outage out; those arriving meanwhile queue up (``rate x outage``, half
    the outage each on average) and the queue then drains at the worker's spare capacity only, so every
    request behind it waits too: the backlog's triangle, ``rate x outage^2 / 2 / (1 - utilization)``
    (a queue's busy period; at 0.9 ten times the outage's own share). Never less than every arrival
    held for the whole outage (the start-up is an estimate); utilization held below 0.95."""
    rho = min(0.95, max(0.0, utilization or 0.0))
    held = rate * outage_s * outage_s
    return waiting * outage_s + max(held, held / 2.0 / (1.0 - rho))
