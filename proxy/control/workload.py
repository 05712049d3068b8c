"""The workload a worker's twin replays: its recent requests as the proxy saw them, and their replay.

:class:`Observed` is an answered request, :class:`InFlight` one still open when a plan begins.
:func:`replay` turns them into the simulator's request specs from one moment on, with the work that
ran alongside the sample (what the worker held then, what it was sent since), so that the twin serves
what the worker served; :func:`continued` adds the traffic that follows the window. What the worker
itself did on the same requests (:meth:`Replay.measured`, :func:`measured_throughput`) is the figure
the twin is judged against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.sim.request import RequestSpec

__all__ = [
    "CONTINUED_COPIES",
    "InFlight",
    "Observed",
    "Replay",
    "continued",
    "measured_throughput",
    "replay",
    "shared_heads",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """One recent request as the proxy saw it (its per-request facts)."""

    arrived: float  # when it reached the proxy (any origin; only differences matter)
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    finished: float | None = None  # when its answer ended (same clock as ``arrived``)
    interactive: bool = True  # the class it was sent as (False: batch)
    # of ``output_tokens``, what an earlier attempt wrote before it was taken back (a restart, a drain):
    # this worker went on from there, that text prefilled as prompt
    written_before: int = 0
    dispatched: float | None = None  # when the proxy sent it to this worker (None: as it arrived)
    first_token: float | None = None  # when its first output reached the proxy (a stream; None: not seen)
    asked_max_tokens: int | None = None  # the client's, where the worker was asked for less (None: ``max_tokens``)
    # its prompt's leading text as a key (requests with the same key share a head), and the prompt tokens
    # the engine found cached for it (None: not known): the prefix sharing the twin replays
    prefix_key: int | None = None
    cached_tokens: int | None = None

    @property
    def asked(self) -> int:
        """The ``max_tokens`` the client asked for (an output budget sends the worker less)."""
        return self.max_tokens if self.asked_max_tokens is None else self.asked_max_tokens

    @property
    def sent(self) -> float:
        """When the worker got it: sent by the proxy, else as it arrived."""
        return self.arrived if self.dispatched is None else self.dispatched

    @property
    def here(self) -> RequestSpec:
        """The work this worker did on it, as a spec arriving at 0 with no rid: what an earlier attempt
        wrote is prompt, what was left to write the output (of ``output_tokens``, at most ``max_tokens``)."""
        before = max(0, min(self.written_before, self.output_tokens - 1, self.max_tokens - 1))
        return RequestSpec(arrival=0.0, prompt_len=max(1, self.prompt_tokens + before),
                           max_new_tokens=max(1, self.max_tokens - before),
                           output_len=max(1, min(self.output_tokens, self.max_tokens) - before))  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlight:
    """A request open on the worker as the plan begins (one of the proxy's attempts): how much it
    will write is not known yet."""

    arrived: float  # same clock as :attr:`Observed.arrived`
    prompt_tokens: int  # estimated
    max_tokens: int | None  # as asked (None: not given)
    interactive: bool = True  # the class it was sent as (False: batch)
    keeps_written: bool = False  # taken back, it keeps what it wrote (the next worker goes on from there)
    written_before: int = 0  # what an earlier attempt wrote (taken back, kept): this worker goes on from there
    dispatched: float | None = None  # when the proxy sent it to this worker (None: as it arrived)
    asked_max_tokens: int | None = None  # the client's, where the worker was asked for less (None: ``max_tokens``)

    @property
    def sent(self) -> float:
        """When the worker got it: sent by the proxy, else as it arrived."""
        return self.arrived if self.dispatched is None else self.dispatched

    @property
    def asked(self) -> int | None:
        """The ``max_tokens`` the client asked for (None: not given)."""
        return self.max_tokens if self.asked_max_tokens is None else self.asked_max_tokens


@dataclass(frozen=True, slots=True)
class Replay:
    """The specs a twin replays and which of them make the figure (the sample's own requests)."""

    specs: tuple[RequestSpec, ...]
    foreground: frozenset[str]  # rids of the sampled requests
    until: float | None = None  # the plan's moment, from the replay's start (None: not known)
    answered: Mapping[str, float] = field(default_factory=dict)  # rid -> when the worker answered it, from the start
    continues_at: float | None = None  # the traffic that follows the window arrives from here on (:func:`continued`)
    start: float | None = None  # the replay's 0 on the requests' clock (None: not known)

    def measured(self) -> float | None:
        """What the worker did over the replay's window: the output (written since the start) of the
        requests it answered by the plan's moment, per second; the figure its counter of generated
        tokens reads, and :attr:`~proxy.control.twin.Prediction.answered_tok_per_s` of the twin (None: no window)."""
        if not self.until:
            return None
        out = {sp.rid: sp.output_len or 0 for sp in self.specs}  # every replayed spec has its length
        return sum(out[rid] for rid, t in self.answered.items() if t <= self.until) / self.until


def _expected_output(answered: Sequence[Observed]) -> Callable[[int, bool], int]:
    """A request's expected output from its ``max_tokens`` and class, read from the answered requests
    of its own class (interactive or batch: chat asks for far more than it writes, a batch of long
    outputs nearly all): the median output over ``max_tokens`` of those that asked for the same, else
    the median output of all of them (no more than it asked for). A class none of whose requests was
    answered yet may write all it asked for: the engine's own admission assumes as much, and the other
    class's lengths say nothing about it (a batch of long outputs read as the chat beside it looked
    like work a lower conservativeness would finish at once, and the plan restarted for it)."""
    by_cap: dict[tuple[bool, int], list[float]] = {}
    written: dict[bool, list[int]] = {}
    for o in answered:
        if o.max_tokens > 0:
            by_cap.setdefault((o.interactive, o.max_tokens), []).append(min(1.0, o.output_tokens / o.max_tokens))
        written.setdefault(o.interactive, []).append(o.output_tokens)
    medians = {key: statistics.median(r) for key, r in by_cap.items()}
    overall = {cls: statistics.median(w) for cls, w in written.items()}

    def expected(cap: int, interactive: bool) -> int:
        if (interactive, cap) in medians:
            return max(1, round(cap * medians[(interactive, cap)]))
        if interactive in overall:
            return max(1, min(cap, round(overall[interactive])))
        return cap

    return expected


def replay(
    sample: Sequence[Observed],
    background: Sequence[Observed] = (),
    in_flight: Sequence[InFlight] = (),
    now: float | None = None,
    start: float | None = None,
    began: float | None = None,
) -> Replay:
    """The sample with the work that ran alongside it (see the module docstring); times from
    ``start`` (default: the sample's first arrival; the sample then arrived after it). ``background``:
    other answered requests (those that ended before the start are left out); ``in_flight``: open
    when the plan began, at ``now``. ``began``: when the worker's current run began (a restart's
    ready): nothing it held then had made progress on it before, so a request running at the start
    has run since the proxy sent it to the worker (its arrival where not known) or since then,
    whichever is later (None: since it was sent). Sent, not arrived: what waited in the proxy's own
    queue (a batch held back beside chat, a backlog) had made no progress there, and one sent after
    the start comes to the twin when it came to the worker (replayed from its arrival before the
    start, a held batch took the twin's pool from the start and the chat beside it waited there).
    Where the proxy saw an answered request's first token (a stream), it knows more: one whose first
    token came after the start was waiting in the worker's queue then (no progress), and one whose
    first token came before was running, writing since then, its KV in place (``resumed``: the twin
    does not prefill it again at its first second, which cost mixed's replays 1-2 s of a 10-13 s
    window). Whole answers, whose first token the proxy does not see, run from when they were sent
    and are prefilled again: of what the worker held some waited in its queue, and resumed all
    alike the perturbed storm's twin read 6 % fast."""
    if not sample and start is None:
        return Replay((), frozenset())
    ordered = sorted(sample, key=lambda o: o.arrived)
    t0 = ordered[0].arrived if start is None else start
    since_run = -math.inf if began is None else min(began, t0)
    specs: list[RequestSpec] = []
    fg: set[str] = set()
    answered: dict[str, float] = {}
    heads = shared_heads([*ordered, *background])
    for i, o in enumerate(ordered):
        rid = f"s{i}"
        fg.add(rid)
        specs.append(replace(_shared(o, heads), arrival=o.arrived - t0, rid=rid))
        if o.finished is not None:
            answered[rid] = o.finished - t0
    sampled = set(map(id, sample))
    for i, o in enumerate(background):
        if id(o) in sampled or o.finished is None or o.finished <= t0:
            continue
        answered[f"b{i}"] = o.finished - t0
        here, sent = _shared(o, heads), o.sent
        if sent >= t0:
            specs.append(replace(here, arrival=sent - t0, rid=f"b{i}"))
            continue
        if o.first_token is not None and o.first_token > t0:  # its first token came later: it was waiting
            specs.append(replace(here, arrival=0.0, rid=f"b{i}"))
            continue
        # its first token seen before the start: it was running, its KV in place, writing since then
        ran_from = sent if o.first_token is None else o.first_token
        left = (o.finished - t0) / (o.finished - max(ran_from, since_run))
        specs.append(_running_at_start(here.prompt_len, here.output_len or 1, here.max_new_tokens, left, f"b{i}",
                                       resumed=o.first_token is not None))  # fmt: skip
    expected = _expected_output(background or sample)
    last = max(((o.finished or o.arrived) for o in ordered), default=t0)  # no plan is older than an answer it read
    end = max(now, last) if now is not None else last
    widest = max((o.max_tokens for o in ordered or background), default=1)  # for one that gave none
    for i, r in enumerate(in_flight):
        whole_cap = r.max_tokens if r.max_tokens and r.max_tokens > 0 else max(1, widest)
        out = expected(whole_cap, r.interactive)
        before = max(0, min(r.written_before, out - 1, whole_cap - 1))  # an earlier attempt's text: prompt here
        prompt, cap, out = r.prompt_tokens + before, whole_cap - before, out - before
        sent = r.sent
        if sent >= t0:
            specs.append(RequestSpec(arrival=sent - t0, prompt_len=max(1, prompt),
                                     max_new_tokens=cap, output_len=out, rid=f"f{i}"))  # fmt: skip
        else:
            ran_from = max(sent, since_run)
            left = (end - t0) / (end - ran_from) if end > ran_from else 1.0
            specs.append(_running_at_start(prompt, out, cap, left, f"f{i}"))
    specs.sort(key=lambda sp: sp.arrival)
    until = end - t0 if now is not None and end > t0 else None
    return Replay(tuple(specs), frozenset(fg), until, answered, start=t0)


def shared_heads(requests: Sequence[Observed]) -> dict[int, int]:
    """Per prefix key that two or more of ``requests`` carry, the head they share: the most prompt
    tokens the engine found cached for one of them (none reported: not known, no sharing replayed)."""
    seen: dict[int, list[int]] = {}
    for o in requests:
        if o.prefix_key is not None:
            seen.setdefault(o.prefix_key, []).append(o.cached_tokens or 0)
    return {key: max(cached) for key, cached in seen.items() if len(cached) > 1 and max(cached) > 0}


def _shared(o: Observed, heads: Mapping[int, int]) -> RequestSpec:
    """``o.here`` with the head its prompt shares with its group's (:func:`shared_heads`), if any."""
    key = o.prefix_key
    head = heads.get(key) if key is not None else None
    return o.here if key is None or not head else replace(o.here, shared=(key, head))


CONTINUED_COPIES = 2  # the sample's requests arrive again this many times after the newest arrival the replay knows


def continued(loaded: Replay, horizon_s: float, copies: int = CONTINUED_COPIES) -> Replay:
    """``loaded`` with the traffic that follows it: the sample's own requests arriving again, as they
    arrived, one copy after another, ``copies`` times or as many as ``horizon_s`` holds if fewer (at
    least one), from one mean gap after the newest arrival the replay knows (the sample's, or a request
    in flight that came after it: what arrived since is there already, and what waits in the proxy's
    own queue is not, the copies stand for it). The window's own figures are not read from it: a copy
    may arrive before the plan's moment."""
    own = [sp for sp in loaded.specs if sp.rid in loaded.foreground]
    if not own or copies < 1:
        return loaded
    first = min(sp.arrival for sp in own)
    last = max(sp.arrival for sp in own)
    # the sample's span and one mean gap more: the next copy's first request comes that gap after its last
    period = (last - first) * len(own) / (len(own) - 1) if len(own) > 1 else 0.0
    begin = max(sp.arrival for sp in loaded.specs) + period / len(own)
    times = max(1, min(copies, math.ceil(horizon_s / period))) if period > 0 else copies
    more = [
        replace(sp, arrival=begin + j * period + (sp.arrival - first), rid=f"{sp.rid}+{j + 1}")
        for j in range(times)
        for sp in own
    ]
    specs = tuple(sorted((*loaded.specs, *more), key=lambda sp: sp.arrival))
    return Replay(specs, loaded.foreground, loaded.until, loaded.answered, continues_at=begin, start=loaded.start)


def _running_at_start(
    prompt: int, output: int, max_tokens: int, left: float, rid: str, resumed: bool = False
) -> RequestSpec:
    """A request already running when the replay starts: what it wrote so far is held as prompt
    (``resumed``: its KV is in place, the twin does not compute it again)."""
    output = max(1, min(output, max_tokens))
    remaining = max(1, min(output, round(output * min(1.0, max(0.0, left)))))
    done = output - remaining
    return RequestSpec(arrival=0.0, prompt_len=max(1, prompt + done), max_new_tokens=max(1, max_tokens - done),
                       output_len=remaining, rid=rid, resumed=resumed)  # fmt: skip


def measured_throughput(workload: Sequence[Observed]) -> float | None:
    """What the worker did on these requests: their output tokens over first arrival to last answer
    (the basis of the twin's own figure for them; None: an answer time is missing)."""
    if not workload or any(o.finished is None for o in workload):
        return None
    span = max(o.finished or 0.0 for o in workload) - min(o.arrived for o in workload)
    return sum(o.here.output_len or 0 for o in workload) / span if span > 0 else None
