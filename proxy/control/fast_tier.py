"""The fast tier: levers the proxy moves itself, in seconds, without restarting a worker.

Per-worker values, recomputed from every scrape by :func:`next_pace` (a pure function of the
previous :class:`Pace` and one :class:`PaceInput`):

* the **admission limit** (AIMD): how many requests the proxy lets the worker hold. Unset at first;
  over-commitment (retractions per 1,000 output tokens above the threshold, smoothed over
  ``rate_window_s``, or, beside batch work, interactive first tokens rising above ``ttft_rise`` x
  their floor) backs it off, at most once per ``hold_s`` and only once the last back-off has
  bitten; it grows by 1/16 per ``hold_s`` of time while it binds and the pool is under-used.
* the **queue target** inside the policy's band: its base for short answers, towards its top for long.
* beside interactive work, the **batch's own queue target and limit**: the batch holds the KV it is
  heading for (:func:`kv_peak`), not what it holds now; batch requests queued ahead of a waiting
  interactive request are taken back. Interactive work never waits behind batch work.
* the **output budget** per class and ``max_tokens`` (:func:`output_budget`): a high quantile of what
  the class's recent answers wrote, with a margin; an answer that reaches it is continued.
* the **hold** at the CUDA graphs' batch, where the planner's last look priced it a gain
  (:func:`held_open`; :mod:`proxy.control.hold`).

Nothing here restarts anything or reads an engine: the inputs are the scrape's engine-neutral
figures and the proxy's per-request facts. No scheduler argument can move without a restart on the
engines supported, so these are the proxy's own levers (docs/controller.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from proxy.control.constants import CONSTANTS, Constants
from proxy.control.evidence import OutputBudget
from proxy.policy import ControlSettings

__all__ = [
    "Pace",
    "PaceInput",
    "PaceSettings",
    "batch_kv_limit",
    "budget_evidence",
    "budget_moved",
    "budget_overrun",
    "held_open",
    "kv_peak",
    "next_pace",
    "output_budget",
    "queue_target",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PaceSettings:
    floor: int = 4  # the limit never goes below this
    ceiling: int = 4096  # grown past this, the limit is lifted
    backoff: float = 0.8  # multiplicative decrease
    grow_divisor: int = 16  # additive increase: limit / grow_divisor (at least 1) per hold_s while it binds
    hold_s: float = (
        5.0  # at most one back-off per hold_s, and no growth within hold_s of one (the constants' backoff_hold_s)
    )
    grow_below_usage: float = 0.9  # grow only while token usage is below this
    ttft_rise: float = 3.0  # back off when recent TTFT exceeds this x its floor (with a server queue)
    retractions_per_1k_tokens: float = 0.5  # back off when the smoothed retraction rate exceeds this
    rate_window_s: float = 30.0  # time constant of the smoothed retraction and token rates
    facts_window_s: float = 60.0  # the worker's facts (mean prompt, output, first token per class) are read over this
    floor_decay: float = 1.02  # the TTFT floor rises by this factor per look (so it can follow a change)
    short_output_tokens: float = 256.0  # mean outputs this short: the band's base
    long_output_tokens: float = 1024.0  # mean outputs this long: the band's top
    batch_queue_beside_interactive: int = 2  # batch requests waiting at the worker while interactive work is there
    interactive_hold_s: float = 5.0  # how long after the last interactive request batch work stays stepped back
    # beside interactive work: how many of the worker's decode steps a streamed interactive request may wait
    # there for its first token before the batch's refills stop (its prefill and the step before it take ~2)
    first_token_steps: float = 4.0
    # beside interactive work: batch requests are taken back while the open ones' KV heads past this
    kv_peak_full: float = 1.0
    output_budget: bool = (
        True  # send plain whole requests at their class's output budget (policy control.output_budget)
    )
    budget_quantile: float = 0.99  # of the recent answers' output tokens ...
    budget_margin: float = 1.5  # ... times this, ...
    budget_step: int = 64  # ... rounded up to a multiple of this
    # answers of the class needed before it has a budget: one new answer in n + 1 is longer than all n, and
    # far fewer past the margin; a budget that holds too few is lifted (budget_overrun_*)
    budget_min_answers: int = 20
    budget_answers: int = 256  # the newest answers of the class it is read from
    budget_floor: int = 256  # never below this many tokens
    budget_note_change: float = 0.25  # a move by this share or more is journaled (set and lifted always are)
    # answers reaching their budget: at least this many, and this share of those that ended under it, lift it
    # (read at the high quantile with a margin, it holds all but a rare one while the answers stay alike)
    budget_overrun_answers: int = 8
    budget_overrun_share: float = 0.1

    @classmethod
    def of(
        cls,
        control: ControlSettings,
        *,
        interactive_window_s: float,
        clock_rate: float = 1.0,
        constants: Constants = CONSTANTS,
    ) -> PaceSettings:
        """A pool's fast tier: the output budget from ``[control]``, the timings and the retraction
        threshold from the controller's constants on the workers' clock (``clock_rate``: engine seconds per
        wall second), the interactive hold from the dispatcher's window in the engine's seconds
        (``interactive_window_s``) on the same clock, the rest at their defaults."""
        k = constants.in_wall(clock_rate)
        return cls(
            output_budget=control.output_budget,
            hold_s=k.backoff_hold_s,
            rate_window_s=k.rate_window_s,
            facts_window_s=k.facts_window_s,
            retractions_per_1k_tokens=k.retractions_per_1k_tokens,
            interactive_hold_s=interactive_window_s / clock_rate,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PaceInput:
    """What one look at a worker shows: its scrape, the proxy's counts, its recent requests."""

    time: float
    running: int
    queue: int  # the server's waiting queue
    token_usage: float
    retractions_total: float | None  # the engine's counter (None: it does not export one)
    generation_tokens_total: float | None = None  # the engine's output-token counter (None: not exported)
    in_flight: int  # what the proxy has open on the worker
    backlog: int  # requests waiting in the proxy's queue
    mean_output_tokens: float | None = None  # of the worker's recent requests, every class (None: none yet)
    # mean time to first token (dispatch to first output) of its recent interactive requests sent to it
    # since the last back-off (None: none answered yet)
    ttft_s: float | None = None
    interactive_output_tokens: float | None = None  # mean output of its recent interactive requests (None: as above)
    interactive_waiting: int = 0  # interactive requests open on the worker or waiting in the proxy for it
    step_s: float | None = None  # the worker's decode step time from the scrape (None: not known)
    # the KV ahead, as a share of the worker's pool: the most its open batch requests are expected to hold
    # at once (:func:`kv_peak`), plus its open interactive requests' whole size (None: not known)
    kv_peak_share: float | None = None
    batch_request_share: float | None = None  # a batch request's prompt and expected output, as a share of the pool
    batch_in_flight: int = 0  # of in_flight, the batch class's
    # where the engine's admission reserves KV for what requests may write: what it counts taken plus the
    # next interactive request's need, and one more batch request's count, as shares of the pool (None: not)
    admission_share: float | None = None
    batch_admission_share: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Pace:
    """One worker's fast-tier values and the little they remember between looks."""

    limit: int | None = None  # None: no limit beyond the queue band
    queue_target: int | None = None  # None: the band's own target
    batch_queue_target: int | None = None  # the batch class's, beside interactive work (None: queue_target)
    # beside interactive work: a streamed interactive request waiting this long at the worker for its first
    # token holds the batch's refills there (None: not beside interactive work, or no step time yet)
    first_token_wait_s: float | None = None
    interactive_seen_at: float = -math.inf  # the latest look with interactive work on or for the worker
    retractions_seen: float | None = None
    tokens_seen: float | None = None
    retraction_ewma: float = 0.0  # smoothed retracted requests per second
    token_ewma: float = 0.0  # smoothed output tokens per second
    rates_seen_s: float = 0.0  # how long the smoothed rates have been fed
    grow_carry: float = 0.0  # growth owed while the limit binds, not yet a whole request
    looked_at: float | None = None  # the previous look's time
    ttft_floor: float | None = None
    backed_off_at: float = -math.inf
    # beside interactive work: the batch requests the worker may hold, sized by the KV ahead (None: no cap)
    batch_limit: int | None = None
    take_back_batch: int = 0  # the newest batch requests open on the worker to take back now (KV past the pool)
    reason: str = ""  # why the limit last moved (for the status page and logs)


def kv_peak(open_requests: Sequence[tuple[int, int]]) -> int:
    """The most KV tokens ``open_requests`` (each: tokens held now, output tokens still to write) hold at
    once from now on, each writing one token a step until it ends: before the request that ends ``r``
    steps from now does, those still running hold what they hold now plus ``r`` tokens each."""
    ordered = sorted(open_requests, key=lambda held_left: held_left[1])
    held_after = sum(held for held, _ in ordered)  # what the requests not yet ended hold now
    peak = held_after
    for k, (held, left) in enumerate(ordered):
        peak = max(peak, held_after + left * (len(ordered) - k))
        held_after -= held
    return peak


def _increase(before: float | None, now: float | None) -> float | None:
    """A counter's increase between two looks (None: not known; a drop is a reset, counted as 0)."""
    if before is None or now is None:
        return None
    return max(0.0, now - before)


def queue_target(lo: int, hi: int, headroom: int, mean_output_tokens: float | None, settings: PaceSettings) -> int:
    """The server-queue target inside ``[lo, hi]`` for a worker whose recent outputs average this long."""
    base = max(1, min(lo + headroom, hi))
    if mean_output_tokens is None or hi <= base:
        return base
    span = max(1.0, settings.long_output_tokens - settings.short_output_tokens)
    share = min(1.0, max(0.0, (mean_output_tokens - settings.short_output_tokens) / span))
    return max(base, min(hi, round(base + share * (hi - base))))


def output_budget(written: Sequence[int], settings: PaceSettings) -> int | None:
    """The output budget of one class of one worker from what its recent answers wrote (``written``,
    output tokens, newest last); None: off, or too few answers to say."""
    high = _high(written, settings)
    if high is None:
        return None
    step = settings.budget_step
    return max(settings.budget_floor, math.ceil(high * settings.budget_margin / step) * step)


def _high(written: Sequence[int], settings: PaceSettings) -> int | None:
    if not settings.output_budget or len(written) < settings.budget_min_answers:
        return None
    recent = sorted(written[-settings.budget_answers :])
    return recent[min(len(recent) - 1, max(0, math.ceil(settings.budget_quantile * len(recent)) - 1))]


def budget_overrun(reached: int, ended_within: int, settings: PaceSettings) -> bool:
    """Whether answers reaching an output budget say it is too small: since it took its value, over
    the facts' window (``facts_window_s``: a rare answer reaching it must not add up over hours),
    ``reached`` answers wrote to it in their first part (each then goes on in another) and
    ``ended_within`` ended within it. Read at the ``budget_quantile`` of what was written, with
    ``budget_margin``, it holds all but a rare answer while the answers stay alike; when they get
    longer, every one reaches it, and none ends to say so (they go on part by part, each part at the
    back of the engine's queue): the budget has to go at once, not when the long answers have ended."""
    return reached >= settings.budget_overrun_answers and reached >= settings.budget_overrun_share * (
        reached + ended_within
    )


def budget_moved(old: int | None, new: int | None, settings: PaceSettings) -> bool:
    """Whether a budget change is worth the journal: set, lifted, or moved by ``budget_note_change``
    or more (a budget read from a sliding window of answers moves by a step now and then)."""
    if old is None or new is None:
        return old != new
    return abs(new - old) >= settings.budget_note_change * old


def held_open(limit: int | None, most: int | None) -> tuple[int | None, str | None]:
    """The admission limit under a hold of at most ``most`` open requests (None: no hold), and why it
    binds (None: it does not): the planner's look priced holding the worker at its CUDA graphs' batch
    (:mod:`proxy.control.hold`)."""
    if most is None or (limit is not None and limit <= most):
        return limit, None
    return most, f"held at {most} open, the batch its CUDA graphs cover (the planner's twin priced it)"


def budget_evidence(
    written: Sequence[int],
    interactive: bool,
    asked: int,
    old: int | None,
    new: int | None,
    settings: PaceSettings,
    applies_above: int | None = None,
    overrun: tuple[int, int] | None = None,
) -> OutputBudget:
    """The journal's evidence of a budget change (what :func:`output_budget` read); ``applies_above``:
    the least ``max_tokens`` of a request it applies to (the request path's rule); ``overrun``: the
    answers that reached it and those that ended within it, when it was lifted for that
    (:func:`budget_overrun`)."""
    high = _high(written, settings)
    return OutputBudget(request_class="interactive" if interactive else "batch", max_tokens=asked, budget_tokens=new,
                        applies_above_tokens=applies_above, previous_tokens=old, answers=min(len(written), settings.budget_answers),
                        high_tokens=high or 0, quantile=settings.budget_quantile,
                        margin=settings.budget_margin, reached=None if overrun is None else overrun[0],
                        ended_within=None if overrun is None else overrun[1])  # fmt: skip


def next_pace(prev: Pace, look: PaceInput, *, lo: int, hi: int, headroom: int, settings: PaceSettings) -> Pace:
    """The worker's pace after one more look (pure: same inputs, same answer)."""
    now = look.time
    interactive_seen_at = now if look.interactive_waiting > 0 else prev.interactive_seen_at
    beside_interactive = now - interactive_seen_at < settings.interactive_hold_s
    target, batch_target, wait = _class_targets(look, beside_interactive, lo, hi, headroom, settings)
    batch_limit, take_back = batch_kv_limit(look, settings) if beside_interactive else (None, 0)
    r_inc = _increase(prev.retractions_seen, look.retractions_total)
    t_inc = _increase(prev.tokens_seen, look.generation_tokens_total)
    dt = now - prev.looked_at if prev.looked_at is not None else 0.0
    r_ewma, t_ewma, seen_s = _smoothed_rates(prev, r_inc, t_inc, dt, settings)
    retracted = _retractions_rose(look, r_inc, r_ewma, t_ewma, seen_s, settings)
    slow = _first_token_rose(prev, look, settings)
    state = replace(
        prev,
        queue_target=target,
        batch_queue_target=batch_target,
        first_token_wait_s=wait,
        interactive_seen_at=interactive_seen_at,
        retractions_seen=look.retractions_total,
        tokens_seen=look.generation_tokens_total,
        retraction_ewma=r_ewma,
        token_ewma=t_ewma,
        rates_seen_s=seen_s,
        grow_carry=0.0,
        looked_at=now,
        ttft_floor=_ttft_floor(prev.ttft_floor, look, settings),
        batch_limit=batch_limit,
        take_back_batch=take_back,
    )
    if now - prev.backed_off_at < settings.hold_s:  # within a hold of the last back-off: the limit stays
        return state
    if (retracted or slow) and _backoff_bitten(prev, look):
        return _back_off(prev, look, state, "retractions rose" if retracted else "time to first token rose", settings)
    return state if retracted else _grow(prev, look, state, dt, settings)


def _interactive_output(look: PaceInput) -> float | None:
    """The mean output of the worker's recent interactive requests, else of all of them (None: none yet)."""
    return look.mean_output_tokens if look.interactive_output_tokens is None else look.interactive_output_tokens


def _class_targets(
    look: PaceInput, beside_interactive: bool, lo: int, hi: int, headroom: int, settings: PaceSettings
) -> tuple[int, int | None, float | None]:
    """The queue target, the batch's own queue target and the first-token wait that holds the batch's
    refills: beside interactive work the band's target is the interactive class's, from its own outputs."""
    if not beside_interactive:
        return queue_target(lo, hi, headroom, look.mean_output_tokens, settings), None, None
    target = queue_target(lo, hi, headroom, _interactive_output(look), settings)
    batch_target = max(1, min(settings.batch_queue_beside_interactive, target))
    wait = None if look.step_s is None else settings.first_token_steps * look.step_s
    return target, batch_target, wait


def _smoothed_rates(
    prev: Pace, r_inc: float | None, t_inc: float | None, dt: float, settings: PaceSettings
) -> tuple[float, float, float]:
    """The retraction and token rates smoothed over ``rate_window_s`` and how long they have been fed,
    after counter increases ``r_inc`` and ``t_inc`` over ``dt`` seconds (unchanged when not known)."""
    if not (dt > 0 and r_inc is not None and t_inc is not None):
        return prev.retraction_ewma, prev.token_ewma, prev.rates_seen_s
    a = 1.0 - math.exp(-dt / settings.rate_window_s)  # the same smoothing in time whatever the scrape interval
    r_ewma = (1 - a) * prev.retraction_ewma + a * r_inc / dt
    t_ewma = (1 - a) * prev.token_ewma + a * t_inc / dt
    return r_ewma, t_ewma, prev.rates_seen_s + dt


def _retractions_rose(
    look: PaceInput, r_inc: float | None, r_ewma: float, t_ewma: float, seen_s: float, settings: PaceSettings
) -> bool:
    """Whether retractions are a sign of over-commitment: with no token counter, any rise of the
    retraction counter; else retractions per 1,000 output tokens over the window above the threshold
    (a burst or a steady trickle is not a sign)."""
    if look.generation_tokens_total is None:
        return bool(r_inc)
    return (
        bool(r_inc)
        and seen_s >= settings.rate_window_s
        and t_ewma > 0
        and r_ewma / t_ewma * 1000.0 > settings.retractions_per_1k_tokens
    )


def _ttft_floor(floor: float | None, look: PaceInput, settings: PaceSettings) -> float | None:
    """The time-to-first-token floor after this look: the least seen, rising by ``floor_decay`` a look."""
    if look.ttft_s is not None and look.ttft_s > 0:
        return look.ttft_s if floor is None else min(look.ttft_s, floor * settings.floor_decay)
    return floor


def _first_token_rose(prev: Pace, look: PaceInput, settings: PaceSettings) -> bool:
    """Whether interactive first tokens rose past ``ttft_rise`` x their floor with a server queue, beside
    batch work (only for latency-bound work: long answers wait for their first token whatever the
    limit). With interactive work alone a limit cannot bring a first token sooner: the requests it
    holds back wait in the proxy's queue instead of the worker's, in the same order, and the running
    batch a burst would have joined is smaller (docs/benchmarks.md, the output budget)."""
    chat_output = _interactive_output(look)
    latency_bound = chat_output is None or chat_output < settings.long_output_tokens
    return (
        look.batch_in_flight > 0
        and latency_bound
        and look.ttft_s is not None
        and prev.ttft_floor is not None
        and look.queue > 0
        and look.ttft_s > settings.ttft_rise * prev.ttft_floor
    )


def _held_now(look: PaceInput) -> int:
    """The requests the worker holds now, by the proxy's count or the server's."""
    return max(look.in_flight, look.running + look.queue)


def _backoff_bitten(prev: Pace, look: PaceInput) -> bool:
    """Whether the last back-off has bitten: the worker holds no more than it. Until then the requests
    above it are ending by themselves, and a sign read while they do is the one it already answered."""
    return prev.limit is None or _held_now(look) <= prev.limit


def _back_off(prev: Pace, look: PaceInput, state: Pace, why: str, settings: PaceSettings) -> Pace:
    """``state`` with the limit backed off multiplicatively from what the worker holds (or its limit)."""
    held_now = _held_now(look)
    base = held_now if prev.limit is None else min(prev.limit, held_now)
    limit = max(settings.floor, math.floor(base * settings.backoff))
    return replace(state, limit=limit, backed_off_at=look.time, reason=f"backed off to {limit}: {why}")


def _grow(prev: Pace, look: PaceInput, state: Pace, dt: float, settings: PaceSettings) -> Pace:
    """``state`` with the limit grown while it binds with work waiting and the pool under-used (else
    ``state``): limit / grow_divisor (at least 1) per hold_s of binding, whatever the scrape interval: the
    share of a step since the last look (one hold's worth at most), what is not yet a whole request carried
    to the next; grown past the ceiling, the limit is lifted."""
    if prev.limit is None or not (
        look.backlog > 0 and look.in_flight >= prev.limit and look.token_usage < settings.grow_below_usage
    ):
        return state
    owed = max(1.0, prev.limit / settings.grow_divisor) * min(dt, settings.hold_s) / settings.hold_s
    owed += prev.grow_carry
    step = math.floor(owed)
    if step == 0:
        return replace(state, grow_carry=owed)
    limit = prev.limit + step
    if limit > settings.ceiling:
        return replace(state, limit=None, reason="limit lifted: grown past the ceiling")
    return replace(state, limit=limit, grow_carry=owed - step, reason=f"grew to {limit}: under-used with work waiting")


def batch_kv_limit(look: PaceInput, settings: PaceSettings) -> tuple[int | None, int]:
    """Beside interactive work, the batch requests the worker may hold, sized by the KV the open requests
    are heading for (``look.kv_peak_share``, :func:`kv_peak`), and how many of the newest to take back
    now: those open, plus the batch requests (each ``look.batch_request_share`` of the pool: its prompt
    and expected output) that fit under ``grow_below_usage`` once the open ones have written what they
    are expected to; past ``kv_peak_full``, less the ones that take it past ``grow_below_usage`` (taken
    back to where the sizing keeps it: a chat request then finds room at once). The batch always keeps
    one request going (interactive work that fills the pool on its own does not stop it for good). It
    grows no further than the next interactive request's admission allows (:func:`_admission_limit`).
    ``(None, 0)``: not sized (no interactive work beside, nothing of the batch's open, or the pool or
    the step time not known)."""
    ahead, size = look.kv_peak_share, look.batch_request_share
    if ahead is None or not size:
        return None, 0
    if ahead > settings.kv_peak_full:  # back to where the sizing keeps it, so the chat finds room at once
        take = math.ceil((ahead - settings.grow_below_usage) / size - 1e-9)
        take = max(0, min(look.batch_in_flight - 1, take))
        return max(1, look.batch_in_flight - take), take
    limit = look.batch_in_flight + max(0, math.floor((settings.grow_below_usage - ahead) / size))
    room = _admission_limit(look)
    return max(1, limit if room is None else min(limit, room)), 0


def _admission_limit(look: PaceInput) -> int | None:
    """The batch requests the worker may hold for the next interactive request to be admitted at once
    where the engine's admission reserves KV for what requests may write (one that counts a running
    request's remaining ``max_tokens`` times a live ratio, high at its start and again after a
    retraction): beyond it the chat waits in the engine's queue for a batch request to end, however
    little KV is in use. No take-back: the first token's watch does that where one waits (None: not
    reserved, or not known)."""
    taken, one = look.admission_share, look.batch_admission_share
    if taken is None or not one:
        return None
    return look.batch_in_flight + math.floor((1.0 - taken) / one)
