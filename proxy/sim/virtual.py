"""Run a whole workload in virtual time, as fast as the CPU allows (no sleeping, no sockets).

    result = simulate(config, [RequestSpec(arrival=0.0, prompt_len=800, max_new_tokens=1600), ...])

The same :class:`~proxy.sim.engine.Engine` as the HTTP server drives; same config, same seed and the
same requests in the same order give the same result. Times are on the engine's clock: modelled
seconds divided by ``config.time_scale`` (1 for the modelled GPU itself).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine, LogFn, QueueFull
from proxy.sim.prefix_first import PrefixFirst, prefix_group
from proxy.sim.request import Req, RequestSpec


# not frozen: one is made every simulated step, and a frozen one sets each field through
# object.__setattr__, a cost felt per step; nothing changes one after it is made
@dataclass(slots=True)
class TracePoint:
    time: float
    queue: int  # #queue-req
    running: int  # #running-req
    token_usage: float
    kind: str  # the step that just ended: "prefill" | "decode"


@dataclass(frozen=True, slots=True)
class RequestResult:
    rid: str
    arrival: float
    first_token_time: float | None
    finish_time: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    num_retractions: int
    finish_reason: str  # "stop" | "length" | "abort" | "unfinished"


@dataclass(frozen=True, slots=True)
class SimResult:
    output_tokens: int
    prompt_tokens: int
    makespan_s: float
    output_tok_per_s: float
    retractions: int
    finished: int
    rejected: int  # refused: queue full
    oom: str | None  # None, "prefill" or "decode": the server died there
    steps: int
    trace: tuple[TracePoint, ...]
    requests: tuple[RequestResult, ...]
    # (time, running, used tokens, gen throughput, cuda graph) at each decode statistics line, as it would log them
    decode_stats: tuple[tuple[float, int, int, float, bool], ...] = field(default=(), repr=False)
    # why it stopped short of its work, not getting it done (:func:`step_bound`, :data:`EMPTY_STEPS`); None: it did not
    stalled: str | None = None


# A replay's step bound: a decode step writes a token for each request it runs, and a prefill step
# takes at least a chunk of a prompt, so work that gets done takes at most about one step per output
# token plus a few per request. Past that the replay is not getting its work done; it stops.
STEPS_PER_OUTPUT_TOKEN = 2
STEPS_PER_REQUEST = 64
# Steps in a row that run nothing (a decode round with its whole batch retracted, the pool unable to take
# the next chunk of a prompt between chunks): the engine is stuck, however long it would go on. A
# planner's replay stuck so took 3.9 million such steps, each a few microseconds of modelled time, and
# its process grew to 7 GB: it made one plan in a retraction-storm run's hour.
EMPTY_STEPS = 1000


def step_bound(workload: Sequence[RequestSpec]) -> int:
    """The most steps a replay of ``workload`` may take (:data:`STEPS_PER_OUTPUT_TOKEN`)."""
    tokens = sum(spec.output_len or spec.max_new_tokens for spec in workload)
    return STEPS_PER_OUTPUT_TOKEN * tokens + STEPS_PER_REQUEST * len(workload)


@functools.cache
def _filler(size: int) -> tuple[int, ...]:
    """Token ids 1..size-1, built once per size (a power of two) and shared by every prompt cut from it."""
    return tuple(range(1, size))


def _prompt(spec: RequestSpec, index: int) -> tuple[int, ...]:
    """A workload request's prompt ids: its own where it gives them, else a first token no other request
    has (no shared prefix: the radix cache matches from the first token) and the rest cut from one shared
    filler, so a prompt costs its tuple's slots and no integers of its own (24,000-token prompts held
    ~36 bytes a token as ranges of their own: a planner's replays of prefill-oom, 380 MB)."""
    if spec.prompt_ids is not None:
        return tuple(spec.prompt_ids)
    length = max(1, spec.prompt_len)
    group, head = spec.shared if spec.shared is not None else (0, 0)
    head = min(max(0, head), length - 1)
    if head > 0:  # its group's head (a first token of the group's, then the filler), then its own
        own = length - head
        filler = _filler(1 << (max(head, own) - 1).bit_length())
        return (SHARED_BASE + group, *filler[: head - 1], -(index + 1), *filler[: own - 1])
    return (-(index + 1), *_filler(1 << (length - 1).bit_length())[: length - 1])


SHARED_BASE = 1 << 40  # a shared head's first token: this plus its group (no request's own first token)


class _Gate:
    """The proxy in front of a replay's engine: what waits outside it, in the proxy's order, and what
    it sent (``queue_cap`` None: each request reaches the engine as it arrives)."""

    def __init__(self, workload: Sequence[RequestSpec], queue_cap: int | None, prefix_first: int) -> None:
        self.workload = workload
        self.queue_cap = queue_cap
        self.outside = PrefixFirst(lambda i: prefix_group(workload[i]), prefix_first if queue_cap is not None else 0)
        self.outside.add(sorted(range(len(workload)), key=lambda i: workload[i].arrival))
        self.sent: dict[str, int] = {}  # rid -> the workload's index, while the engine holds it
        self.reqs: list[Req] = []
        self.rejected = 0

    def send(self, eng: Engine, t: float) -> int | None:
        """Send what arrived by ``t`` until ``queue_cap`` wait at the engine; the oldest still outside."""
        cap = self.queue_cap if self.queue_cap is not None else len(self.workload) + 1

        def arrived(i: int) -> bool:
            return self.workload[i].arrival <= t

        while (head := self.outside.head()) is not None and arrived(head) and len(eng.waiting) < cap:
            i = self.outside.take(arrived)
            req = _add(eng, self.workload[i], i, t, outside=self.queue_cap is not None)
            if req is None:
                self.rejected += 1
                self.outside.ended(i, answered=False)
            else:
                self.reqs.append(req)
                self.sent[req.rid] = i
        return head

    def done(self, finished: Sequence[Req]) -> None:
        for r in finished:
            if (index := self.sent.pop(r.rid, None)) is not None:
                self.outside.ended(index, answered=True)


def simulate(
    config: SimConfig,
    workload: Sequence[RequestSpec],
    *,
    log: LogFn | None = None,
    max_time: float | None = None,
    queue_cap: int | None = None,
    gate_period_s: float = 0.0,
    prefix_first: int = 0,
) -> SimResult:
    """Run ``workload`` through one engine in virtual time. ``queue_cap``: a proxy's gate in front of the
    engine, which looks at its queue every ``gate_period_s`` and then sends what arrived until ``queue_cap``
    wait there (the rest wait outside, their waiting counted from their arrival, in arrival order or, with
    ``prefix_first``, in the proxy's order where it sorts by prefix: :mod:`proxy.sim.prefix_first`); None:
    each request reaches the engine as it arrives. A replay stops, ``stalled``, at its step bound
    (:func:`step_bound`) or after :data:`EMPTY_STEPS` steps in a row that ran nothing."""
    eng = Engine(config, log=log)
    bound = step_bound(workload)
    stalled: str | None = None
    empty = 0  # steps in a row that ran nothing
    next_gate = 0.0
    gate = _Gate(workload, queue_cap, prefix_first)
    head = gate.outside.head()
    trace: list[TracePoint] = []
    oom: str | None = None
    t = 0.0
    steps = 0
    while True:
        if queue_cap is None or t >= next_gate:
            head = gate.send(eng, t)
            if queue_cap is not None:
                next_gate = t + gate_period_s
        step = eng.plan(t)
        if step is None:
            if head is None or (queue_cap is not None and len(eng.waiting) >= queue_cap):
                break  # all in; or a full queue at the gate that the engine cannot start on
            t = max(workload[head].arrival, next_gate if queue_cap is not None else 0.0)
            continue
        if step.oom is not None:
            oom = step.oom
            break
        t += step.duration
        gate.done(eng.complete(step, t).finished)
        steps += 1
        trace.append(TracePoint(t, len(eng.scheduler.waiting), eng.kv.running.n, eng.kv.usage, step.kind))
        if max_time is not None and t >= max_time:
            break
        empty = empty + 1 if step.batch_size == 0 else 0
        if empty >= EMPTY_STEPS:
            stalled = f"{EMPTY_STEPS} rounds in a row ran nothing"
        elif steps >= bound:
            stalled = f"{bound} steps, its step bound, did not get its work done"
        if stalled:
            break
    results = tuple(_result(eng, r) for r in gate.reqs)
    out_tokens = sum(rr.output_tokens for rr in results)
    return SimResult(
        output_tokens=out_tokens,
        prompt_tokens=sum(rr.prompt_tokens for rr in results),
        makespan_s=t,
        output_tok_per_s=out_tokens / t if t > 0 else 0.0,
        retractions=eng.retracted_total,
        finished=sum(1 for rr in results if rr.finish_reason in ("stop", "length")),
        rejected=gate.rejected,
        oom=oom,
        steps=steps,
        trace=tuple(trace),
        requests=results,
        decode_stats=tuple(eng.reporter.decode_stats),
        stalled=stalled,
    )


def _add(eng: Engine, spec: RequestSpec, index: int, now: float, *, outside: bool) -> Req | None:
    """``spec`` (the workload's ``index``-th) into the engine at ``now``; None: its queue is full.
    ``outside``: it waited at a gate in front of the engine, its waiting counted from its arrival."""
    try:
        req = eng.add(
            prompt_ids=_prompt(spec, index),
            max_new_tokens=spec.max_new_tokens,
            ignore_eos=spec.ignore_eos,
            output_len=spec.output_len,
            rid=spec.rid,
            now=max(now, spec.arrival),
            resumed=spec.resumed,
        )
    except QueueFull:
        return None
    if outside:
        req.arrival = spec.arrival
    return req


def _result(eng: Engine, r: Req) -> RequestResult:
    reason = r.finish_reason["type"] if r.finish_reason else "unfinished"
    return RequestResult(
        rid=r.rid,
        arrival=r.arrival,
        first_token_time=r.first_token_time,
        finish_time=r.finish_time,
        prompt_tokens=r.prompt_len,
        output_tokens=eng.output_len(r),
        cached_tokens=r.cached_tokens,
        num_retractions=r.num_retractions,
        finish_reason=reason,
    )
