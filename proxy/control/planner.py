"""The planner: a calibrated twin of a worker replays its recent workload under candidate arguments.

The twin is the simulator's virtual-time core (:func:`proxy.sim.virtual.simulate`) standing for one
worker: an SGLang model, reached through the engine contract (the argument names its knobs move, the
arguments its twin reads) and :mod:`proxy.sim.twin`.

Calibration (:func:`calibrate`): the step time from the worker's own decode lines (the median of
expected over measured decode rate at the same batch; it absorbs a simulated worker's time scale),
the KV pool from its start-up line. A real GPU the simulator does not name starts from the
constants' presets and is calibrated the same way.

A :class:`Plan` (:func:`plan`): the newest requests are replayed under the current arguments and a
bounded set of candidates (:func:`candidates`); the best is worth a restart only when its predicted
gain over the horizon (:mod:`proxy.control.horizon`) pays the restart cost measured on this worker
(:class:`RestartCost`: start-up, drain, work taken back and computed again), and no candidate leaves
less free memory at start-up than the band's floor. A gain inside the twin's error says neither way.
The verdict is computed in numbers and a why-code (:func:`verdict`), its words apart (:func:`explain`).

An acted plan is checked on the requests served under its arguments (:func:`check_outcome`): the
journal gets the predicted and the measured gain side by side.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.control.rules import Activations
from proxy.engines.base import KnobName
from proxy.engines.contract import Engine
from proxy.sim.config import SimConfig, SimConfigError
from proxy.sim.presets import GPUS, MIB
from proxy.sim.request import RequestSpec
from proxy.sim.startup import capacity_line
from proxy.sim.steptime import startup_seconds
from proxy.sim.twin import TWIN_ENGINE, memory_fraction, prefill_chunk, twin_config
from proxy.sim.virtual import simulate

__all__ = [
    "ERROR_LOOKS",
    "DecodeStats",
    "Expectation",
    "InFlight",
    "Looks",
    "Observed",
    "Outcome",
    "OutcomeInputs",
    "Plan",
    "PlanInputs",
    "PlanSettings",
    "Prediction",
    "Replay",
    "RestartCost",
    "Twin",
    "Verdict",
    "Why",
    "args_key",
    "calibrate",
    "candidates",
    "check_outcome",
    "continued",
    "explain",
    "measured_throughput",
    "outage_waiting_s",
    "plan",
    "replay",
    "run_plan",
    "twin_error",
    "verdict",
]


@dataclass(frozen=True, slots=True)
class ArgNames:
    """The names of the arguments the planner moves, as an engine's knobs name them."""

    conservativeness: str
    max_running: str
    prefill_chunk: str
    memory_fraction: str

    @classmethod
    def of(cls, engine: Engine) -> ArgNames:
        k = engine.knobs
        return cls(
            conservativeness=k[KnobName.CONSERVATIVENESS].arg,
            max_running=k[KnobName.MAX_RUNNING].arg,
            prefill_chunk=k[KnobName.PREFILL_CHUNK].arg,
            memory_fraction=k[KnobName.MEMORY_FRACTION].arg,
        )


TWIN_NAMES = ArgNames.of(TWIN_ENGINE)


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

    @property
    def sent(self) -> float:
        """When the worker got it: sent by the proxy, else as it arrived."""
        return self.arrived if self.dispatched is None else self.dispatched


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
        tokens reads, and :attr:`Prediction.answered_tok_per_s` of the twin (None: no window)."""
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
    for i, o in enumerate(ordered):
        rid = f"s{i}"
        fg.add(rid)
        specs.append(replace(o.here, arrival=o.arrived - t0, rid=rid))
        if o.finished is not None:
            answered[rid] = o.finished - t0
    sampled = set(map(id, sample))
    for i, o in enumerate(background):
        if id(o) in sampled or o.finished is None or o.finished <= t0:
            continue
        answered[f"b{i}"] = o.finished - t0
        here, sent = o.here, o.sent
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


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeStats:
    """One decode-batch statistic of the worker: requests running, tokens they hold, tokens/s."""

    running: int
    used_tokens: int
    gen_throughput: float
    cuda_graph: bool = True
    at: float | None = None  # when the worker logged it, on the requests' clock (None: not known)


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
    # a predicted gain below this is noise, whatever the horizon (and a loss below it: see _no_worse)
    min_gain: float = 0.03
    conservativeness: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3)
    conservativeness_bounds: tuple[float, float] = (0.1, 2.0)
    memory_fraction_step: float = 0.01  # the controller passes its constants' memory_fraction_step
    memory_fraction_bounds: tuple[float, float] = (0.5, 0.95)
    min_available_gb: float = 5.0  # free memory at start-up below this: not a candidate (the band's floor)
    max_available_gb: float | None = None  # the band's top: more free than this is a KV pool left unused


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    args: Mapping[str, object]
    output_tok_per_s: float  # 0 when the twin would not start or dies of OOM
    mean_queue_s: float | None  # arrival to first token
    mean_answer_s: float | None = None  # arrival to the end of the answer (the sample's own, all of them answered)
    # what the worker is measured on (:meth:`Replay.measured`): the output of the requests answered
    # by the plan's moment, per second of the window; the sample alone (no window): its output over its
    # first arrival to its last answer (:func:`measured_throughput`). None: not known, or it died
    answered_tok_per_s: float | None = None
    makespan_s: float
    retractions: int
    oom: str | None = None
    available_gpu_mem_gb: float | None = None
    peak_running: int = 0  # the largest running batch of the replay


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartCost:
    """What one restart of this worker costs, as measured on it.

    What was in flight is computed again: the output it had written is decoded again (a whole answer
    taken back starts over), at the worker's decode pace, and its prompts are prefilled again, which
    a GPU does many times faster than it decodes: ``refill_s``, the twin's prefill time for them on
    the worker's calibrated clock (:func:`run_plan`). A first build counted the prompts as output
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


@dataclass(frozen=True, slots=True)
class Twin:
    """One worker's model: the simulator's presets and this worker's correction factors."""

    gpu: str
    model: str
    step_time_factor: float = 1.0
    kv_factor: float = 1.0
    engine: Engine = TWIN_ENGINE  # the engine whose workers it models: the arguments it reads and moves

    @property
    def names(self) -> ArgNames:
        return ArgNames.of(self.engine)

    def config(self, args: Mapping[str, object]) -> SimConfig:
        """The twin's resolved config under ``args`` (raises SimConfigError: would not start)."""
        own = self.engine.twin_args(args)
        if own is None:
            raise SimConfigError(f"the twin does not model {self.engine.name}'s workers")
        return twin_config(self.gpu, self.model, own, step_time_factor=self.step_time_factor, kv_factor=self.kv_factor)

    def prefill_seconds(self, args: Mapping[str, object], tokens: float, requests: int) -> float:
        """The worker's time to prefill ``requests`` prompts of ``tokens`` in all, in chunks of its
        prefill size (the twin's step model on its calibrated clock; 0: the twin would not start)."""
        try:
            cfg = self.config(args)
        except SimConfigError:
            return 0.0
        if tokens <= 0 or requests <= 0:
            return 0.0
        steps = cfg.step_model()
        chunk = prefill_chunk(cfg) or int(tokens)
        each = tokens / requests
        seconds, left = 0.0, float(tokens)
        while left > 0:
            take = min(float(chunk), left)
            seqs = max(1, round(take / each))
            seconds += steps.prefill_seconds(int(take), seqs * (take / seqs) ** 2 / 2, seqs)
            left -= take
        return seconds * cfg.step_time_factor / cfg.time_scale

    def activations(self, args: Mapping[str, object]) -> Activations | None:
        """The activations of this worker's model under ``args``, for the rules' start-up check
        (:func:`proxy.control.rules.activations_fit`); None: the twin would not start."""
        try:
            cfg = self.config(args)
        except SimConfigError:
            return None
        return Activations(prefill_mib_per_token=cfg.model.prefill_act_mib_per_token,
                           decode_mib_per_seq=cfg.model.decode_act_mib_per_seq,
                           graph_max_bs=cfg.cuda_graph_max_bs_decode, pool_tokens=cfg.memory.max_total_num_tokens,
                           model=f"{self.model} on {self.gpu}")  # fmt: skip

    def startup_line(self, args: Mapping[str, object]) -> str | None:
        """The start-up line this worker would print under ``args`` (resolved capacity, free memory), as
        the simulator prints it: a forecast read before the worker is launched. None: it would not start."""
        try:
            return capacity_line(self.config(args))
        except SimConfigError:
            return None

    def is_gpu(self, total_bytes: int, tolerance: float = 0.02) -> bool:
        """Whether a device of ``total_bytes`` (NVML's total memory) is the twin's GPU preset's size."""
        preset = GPUS.get(self.gpu)
        return preset is not None and abs(total_bytes / MIB - preset.memory_mib) <= tolerance * preset.memory_mib

    def predict(self, args: Mapping[str, object], workload: Sequence[Observed] | Replay) -> Prediction:
        """The twin under ``args`` on ``workload`` (a bare sample replays alone, into an empty engine).
        Queue and answer times are the sample's own; throughput is all the work replayed, drained, where
        the replay has a window or goes on (:func:`continued`), else the sample's own (its output tokens
        over first arrival to last answer); ``answered_tok_per_s`` is the window's (:meth:`Replay.measured`)."""
        try:
            cfg = self.config(args)
        except SimConfigError as exc:
            return Prediction(args=dict(args), output_tok_per_s=0.0, mean_queue_s=None, makespan_s=0.0,
                              retractions=0, oom=f"startup: {exc}")  # fmt: skip
        plan_replay = workload if isinstance(workload, Replay) else replay(workload)
        res = simulate(cfg, list(plan_replay.specs))
        own = [r for r in res.requests if r.rid in plan_replay.foreground]
        waits = [r.first_token_time - r.arrival for r in own if r.first_token_time is not None]
        answers = [r.finish_time - r.arrival for r in own if r.finish_time is not None]
        ends = [r.finish_time for r in own if r.finish_time is not None]
        span = max(ends) - min(r.arrival for r in own) if own and ends else 0.0
        alone = sum(r.output_tokens for r in own) / span if span > 0 and len(ends) == len(own) else None
        window = plan_replay.until
        mine: float | None
        if window:  # with the work that ran alongside: all the work there is, drained
            tp = res.output_tok_per_s
            answered = sum(
                r.output_tokens for r in res.requests if r.finish_time is not None and r.finish_time <= window
            )
            mine = answered / window
        else:  # the sample alone: its own (and going on: all of it, drained)
            tp, mine = res.output_tok_per_s if plan_replay.continues_at is not None else alone or 0.0, alone
        return Prediction(
            args=dict(args),
            answered_tok_per_s=None if res.oom else mine,
            output_tok_per_s=0.0 if res.oom else tp,
            mean_queue_s=sum(waits) / len(waits) if waits else None,
            peak_running=max((p.running for p in res.trace), default=0),
            mean_answer_s=sum(answers) / len(answers) if answers and len(answers) == len(own) and not res.oom else None,
            makespan_s=res.makespan_s,
            retractions=res.retractions,
            oom=res.oom,
            available_gpu_mem_gb=cfg.memory.available_gb,
        )


MIN_SPAN_LINES = 3  # the twin's lines in the worker's span it takes to compare like with like


def _decode_ratio(cfg: SimConfig, decode: Sequence[DecodeStats]) -> float | None:
    """Median of (the step-time model's decode rate at each statistic's batch) / (the rate reported)."""
    steps = cfg.step_model()
    ratios = [
        (d.running / steps.decode_seconds(d.running, max(0, d.used_tokens), d.cuda_graph)) / d.gen_throughput
        for d in decode
        if d.running > 0 and d.gen_throughput > 0
    ]
    return statistics.median(ratios) if ratios else None


def calibrate(
    gpu: str,
    model: str,
    args: Mapping[str, object],
    decode: Sequence[DecodeStats],
    kv_capacity_tokens: int | None,
    workload: Sequence[Observed] | Replay = (),
    refinements: int = 2,
) -> Twin:
    """The twin for a worker running ``args``: presets corrected by what the worker reported.

    The reported generation throughput is measured between two statistics lines, prefill steps
    included, so the same figure is taken from the twin replaying ``workload`` (when given) and the
    factor is corrected by the worker's ratio over the twin's, ``refinements`` times: like with like.
    Where the replay says when it starts and the worker's lines when they were logged, the twin's
    lines are those of the same span (the window's last seconds): what the worker was prefilling and
    decoding then (a batch's long answers, chat's stream of short prompts, a phase beginning) is
    what the twin replays then, and its lines past the window (draining what was open) or long
    before it (another phase) say nothing about the worker's.
    """
    twin = Twin(gpu, model)
    try:
        cfg = twin.config(args)
    except SimConfigError:
        return twin
    kv_factor = 1.0
    if kv_capacity_tokens and cfg.max_total_num_tokens > 0:
        kv_factor = min(1.0, kv_capacity_tokens / cfg.max_total_num_tokens)
    twin = Twin(gpu, model, kv_factor=kv_factor)
    live = _decode_ratio(cfg, decode)
    if live is None:
        return twin
    factor = live
    loaded = workload if isinstance(workload, Replay) else replay(workload)
    specs = list(loaded.specs)
    logged = [d.at for d in decode if d.at is not None]
    span = (min(logged) - loaded.start, max(logged) - loaded.start) if loaded.start is not None and logged else None
    for _ in range(refinements if specs else 0):  # the twin's own lines at the factor found so far
        twin = Twin(gpu, model, step_time_factor=factor, kv_factor=kv_factor)
        res = simulate(twin.config(args), specs)
        lines = list(res.decode_stats)
        if span is not None:
            within = [line for line in lines if span[0] <= line[0] <= span[1]]
            lines = within if len(within) >= MIN_SPAN_LINES else lines  # a twin far off: all its lines, this once
        stats = [DecodeStats(running=r, used_tokens=u, gen_throughput=g, cuda_graph=c) for _, r, u, g, c in lines]
        own = _decode_ratio(cfg, stats)
        if own is None:
            break
        factor *= live / own
    return Twin(gpu, model, step_time_factor=factor, kv_factor=kv_factor)


def args_key(args: Mapping[str, object]) -> str:
    """One candidate's arguments as a key that is the same on every look under the same args."""
    return ",".join(f"{name}={value!r}" for name, value in sorted(args.items()))


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def candidates(
    args: Mapping[str, object], resolved: Mapping[str, float], settings: PlanSettings, names: ArgNames = TWIN_NAMES
) -> list[dict[str, object]]:
    """Bounded candidate args around ``args`` (``resolved``: what the engine chose for unset ones),
    ``names``: the engine's names of the arguments moved."""

    def current(arg: str) -> float | None:
        value = _num(args.get(arg))
        return value if value is not None else resolved.get(arg)

    out: list[dict[str, object]] = []
    cons = current(names.conservativeness) or 1.0
    lo, hi = settings.conservativeness_bounds
    for value in settings.conservativeness:
        if lo <= value <= hi and abs(value - cons) > 1e-9:
            out.append({**args, names.conservativeness: value})
    running = current(names.max_running)
    if running:
        for value in (int(running * 0.5), int(running * 2)):
            if value >= 1:
                out.append({**args, names.max_running: value})
    chunk = current(names.prefill_chunk)
    if chunk and chunk > 0:
        for value in (int(chunk // 2), int(chunk * 2)):
            if 512 <= value <= 16384:
                out.append({**args, names.prefill_chunk: value})
    frac = current(names.memory_fraction)
    if frac:
        flo, fhi = settings.memory_fraction_bounds
        for value in (frac - settings.memory_fraction_step, frac + settings.memory_fraction_step):
            if flo <= value <= fhi:
                out.append({**args, names.memory_fraction: round(value, 3)})
    return out[: settings.max_candidates]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    twin: Twin
    current: Prediction
    best: Prediction  # ``current`` when no candidate beats it
    predicted_gain: float  # best / current throughput - 1
    gain_tokens: float  # (best - current) throughput x the seconds it accrues over
    accrues_s: float  # the horizon, or less where the work waiting is expected gone sooner (the throughput basis)
    cost_tokens: float
    worth: bool  # restart with best.args
    # the gain would pay a restart, but it is inside how far the twin is from the worker on the same
    # requests: the plan can say neither that a restart pays nor that it does not
    undecided: bool = False
    replays: int
    reason: str
    refused: tuple[Prediction, ...] = field(default=())  # candidates outside the memory band
    measured_current: float | None = None  # what the worker did on the replayed requests (same basis)
    # what the restart is for: "throughput" (more tokens per second: a backlog) or "waiting" (the same
    # tokens, answered sooner: arrivals the worker keeps up with, or nearly)
    basis: str = "throughput"
    wait_saved_s: float = 0.0  # request-seconds of waiting the best args save over the horizon
    wait_cost_s: float = 0.0  # request-seconds of waiting the restart adds
    utilization: float | None = None  # the waiting basis: the work arriving over what the new args can do
    refill_s: float = 0.0  # after the restart, the time to prefill again what it took back (the cost's)
    # each served candidate's throughput gain over the current args on this look (:func:`args_key`)
    gains: Mapping[str, float] = field(default_factory=dict)
    # each candidate's request-seconds of waiting saved over the horizon on this look (:func:`waiting_savings`;
    # empty: the waiting basis was not asked)
    savings: Mapping[str, float] = field(default_factory=dict)

    @property
    def current_error(self) -> float | None:
        """|predicted - measured| / measured throughput of the current args on the replayed requests."""
        m, p = self.measured_current, self.current.answered_tok_per_s
        return abs(p - m) / m if m and p is not None else None


def _accrual(accrues_s: float, settings: PlanSettings) -> str:
    """Why a throughput gain accrues over less than the horizon, for the plan's reason ("": the horizon)."""
    if accrues_s >= settings.horizon_s:
        return ""
    return f" (of the {settings.horizon_s:g} s horizon: the work waiting is gone by then)"


class Why(enum.Enum):
    """What a plan's verdict rests on (its reason says it in words: :func:`explain`)."""

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


@dataclass(frozen=True, slots=True)
class _Replayed:
    """The current args and the candidates replayed on one look."""

    sample: list[Observed]
    loaded: Replay
    seen: Prediction  # the current args on the window as it went
    current: Prediction  # the current args going on
    served: list[Prediction]  # the candidates inside the band that did not die
    refused: tuple[Prediction, ...]  # those outside the memory band
    replays: int


def _replayed(
    twin: Twin,
    args: Mapping[str, object],
    workload: Sequence[Observed],
    settings: PlanSettings,
    resolved: Mapping[str, float] | None,
    in_flight: Sequence[InFlight],
    now: float | None,
) -> _Replayed:
    sample = _sample(workload, settings)
    window = replay(sample, workload, in_flight, now)
    loaded = continued(window, settings.horizon_s)
    seen = twin.predict(args, window)  # the window as it went: what the twin is judged on against the worker
    # the current args going on, with the window's own figures (the output answered in it, its answer times)
    current = replace(twin.predict(args, loaded), answered_tok_per_s=seen.answered_tok_per_s)
    refused: list[Prediction] = []
    served: list[Prediction] = []
    replays = 2
    in_band = _band_fraction(twin, args, settings)
    for cand in ([in_band] if in_band is not None else []) + candidates(args, resolved or {}, settings, twin.names):
        p = twin.predict(cand, loaded)
        replays += 1
        if p.available_gpu_mem_gb is not None and p.available_gpu_mem_gb < settings.min_available_gb:
            refused.append(p)
            continue
        if p.oom is None:
            served.append(p)
    return _Replayed(sample, loaded, seen, current, served, tuple(refused), replays)


@dataclass(frozen=True, slots=True)
class _Choice:
    """The throughput basis's candidate: ``best`` (``current``: none), its gain and how it was read."""

    best: Prediction
    gain: float
    paying_looks: int
    roomier_behind: float | None
    replays: int


def _choose(
    twin: Twin,
    r: _Replayed,
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
    roomier = _roomier(twin, best, r.loaded, settings)
    behind = None
    if roomier is not None and _no_worse(roomier.output_tok_per_s, best.output_tok_per_s, settings):
        if roomier.output_tok_per_s < best.output_tok_per_s:
            behind = roomier.output_tok_per_s / best.output_tok_per_s - 1.0
        gain += max(0.0, roomier.output_tok_per_s - best.output_tok_per_s) / base
        best = roomier
    return _Choice(best, gain, paying_looks, behind, int(roomier is not None))


def _waiting(
    twin: Twin,
    r: _Replayed,
    in_flight: int,
    cost: RestartCost,
    settings: PlanSettings,
    earlier_savings: Sequence[Mapping[str, float]],
) -> tuple[WaitingPlan | None, dict[str, float], int]:
    """The waiting basis: its candidate (None: none answers sooner by more than the twin misses this
    worker's answers by), each candidate's waiting saved, and the replays it took."""
    capacities: dict[str, float | None] = {}  # each args' output tokens/s with the sample all waiting

    def capacity(p: Prediction) -> float | None:
        key = args_key(p.args)
        if key not in capacities:
            capacities[key] = _capacity(twin, p, r.loaded)
        return capacities[key]

    current, sample = r.current, r.sample
    savings = waiting_savings(current, r.served, sample, settings, capacity)
    waiting = _waiting_plan(current, r.served, sample, in_flight, cost, settings, savings, earlier_savings, capacity)
    replays = len(capacities)
    if waiting is not None and current.mean_answer_s and waiting.quicker.mean_answer_s is not None:
        sooner = 1.0 - waiting.quicker.mean_answer_s / current.mean_answer_s
        answered = [o.finished - o.arrived for o in sample if o.finished is not None]
        measured_answer = sum(answered) / len(answered) if answered and len(answered) == len(sample) else None
        # the waiting basis is judged on answer time: how far the twin's is from the worker's on the sample
        seen = r.seen.mean_answer_s
        answer_error = abs(seen - measured_answer) / measured_answer if measured_answer and seen is not None else None
        if answer_error is not None and sooner <= answer_error:
            waiting = None  # answers sooner by less than the twin misses this worker's answers by
    if waiting is not None and waiting.saved_s > waiting.cost_s:
        roomier = _roomier(twin, waiting.quicker, r.loaded, settings)
        replays += roomier is not None
        answers = roomier.mean_answer_s if roomier is not None else None
        quickest = waiting.quicker.mean_answer_s
        if roomier is not None and answers is not None and quickest and _no_worse(quickest, answers, settings):
            waiting = replace(waiting, quicker=roomier)
    return waiting, savings, replays


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
    """:func:`plan`'s numbers and choice, without words."""
    r = _replayed(twin, args, workload, settings, resolved, in_flight, now)
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
        waiting, savings, waiting_replays = _waiting(twin, r, len(in_flight), cost, settings, earlier_savings)
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
    return Verdict(why=why, current=current, best=best, base=base, gain=gain, weighed=weighed,
                   paying_looks=choice.paying_looks, this_look_gain=this_look, roomier_behind=choice.roomier_behind,
                   accrues_s=accrues_s, gain_tokens=gain_tokens, cost_tokens=cost_tokens, measured=measured,
                   now_error=now_error, error=error, pays=pays, trusted=trusted, waiting=waiting, gains=gains,
                   savings=savings, refused=r.refused, replays=r.replays + choice.replays + waiting_replays)  # fmt: skip


def _moved(args: Mapping[str, object], to: Prediction) -> str:
    return ", ".join(f"{k} {args.get(k)} -> {v}" for k, v in to.args.items() if args.get(k) != v)


def _waiting_reason(v: Verdict, waiting: WaitingPlan, args: Mapping[str, object], settings: PlanSettings) -> str:
    quicker, saved, paid, utilization = waiting.quicker, waiting.saved_s, waiting.cost_s, waiting.utilization
    assert v.current.mean_answer_s is not None and quicker.mean_answer_s is not None
    return (
        f"{_moved(args, quicker)}: the same tokens answered sooner (mean answer {v.current.mean_answer_s:.1f} -> "
        f"{quicker.mean_answer_s:.1f} s), {saved:.0f} request-seconds of waiting saved over "
        f"{settings.horizon_s:g} s{waiting.over_looks} {'>' if saved > paid else '<='} {paid:.0f} the restart adds"
        + ("" if utilization is None else f" (the worker {utilization:.0%} busy: the outage's queue drains slowly)")
        + _held_up(settings)
    )


def explain(v: Verdict, args: Mapping[str, object], settings: PlanSettings, earlier_errors: int = 0) -> str:
    """The plan's reason, in words, from its verdict; ``earlier_errors``: how many earlier looks the
    twin's error is read over."""
    if v.why is Why.WAITING_PAYS:
        assert v.waiting is not None
        return _waiting_reason(v, v.waiting, args, settings)
    gain, accrual = f"{v.gain:+.1%}", f"{round(v.accrues_s, 1):g} s{_accrual(v.accrues_s, settings)}"
    if v.why is Why.NO_BETTER:
        reason = "no candidate beats the current arguments on the recent workload"
    elif v.why is Why.UNTRUSTED:
        looks = min(ERROR_LOOKS, earlier_errors + (v.now_error is not None))
        reason = (
            f"predicted gain {gain} would pay a restart, but the twin misses what the worker did on the same "
            f"requests by {v.error or 0.0:.1%}"
            + (f" (the median of its last {looks} looks; {v.now_error or 0.0:.1%} on this one)" if looks > 1 else "")
            + ": no restart on it"
        )
    elif v.why is Why.NOTHING_WAITS:
        reason = (
            f"predicted gain {gain}, but nothing waits for the worker: a throughput gain accrues only while work waits"
        )
    elif v.why is Why.DOES_NOT_PAY:
        reason = f"predicted gain {gain} x {accrual} = {v.gain_tokens:.0f} tokens does not pay a restart ({v.cost_tokens:.0f} tokens)"
    else:
        note = ""
        if v.roomier_behind is not None:
            note = (
                f" (with the band's larger KV pool, which the twin puts {v.roomier_behind:+.1%} on these requests: "
                "inside what it cannot tell)"
            )
        if v.paying_looks > 1:
            note += (
                f" (its mean over {v.paying_looks} looks that say a restart pays; {v.this_look_gain:+.1%} on this one)"
            )
        reason = (
            f"{_moved(args, v.best)}: predicted gain {gain} ({v.base:.0f} -> {v.weighed:.0f} tok/s) x {accrual} = "
            f"{v.gain_tokens:.0f} tokens > restart cost {v.cost_tokens:.0f} tokens{note}"
        )
    if v.waiting is not None:
        reason += f"; waiting: {v.waiting.saved_s:.0f} request-seconds saved{v.waiting.over_looks} <= {v.waiting.cost_s:.0f} the restart adds"
        if v.waiting.utilization is not None:
            reason += f" (the worker {v.waiting.utilization:.0%} busy)"
        reason += _held_up(settings)
    return reason


def plan(
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
) -> Plan:
    """Replay the newest requests, with the work in flight alongside them, under ``args`` and the
    candidates; restart only if it pays (:func:`verdict`, in words by :func:`explain`). ``earlier_errors``:
    the twin's error on the worker's earlier looks under the same args, newest last (:func:`twin_error`);
    ``earlier_gains``: the candidates' gains (:attr:`Plan.gains`) on the earlier looks that said a restart
    pays, none saying no since: a candidate is chosen, and the restart weighed, on its mean gain over
    those looks and this one; ``earlier_savings``: the candidates' waiting saved (:attr:`Plan.savings`)
    on the earlier looks that asked the waiting basis, whatever they said: the waiting basis weighs its
    mean over them and this one."""
    v = verdict(twin, args, workload, cost, settings, resolved, in_flight, now, earlier_errors, earlier_gains,
                earlier_savings)  # fmt: skip
    reason = explain(v, args, settings, len(earlier_errors))
    throughput = Plan(
        twin=twin,
        current=v.current,
        best=v.best,
        predicted_gain=v.gain,
        gain_tokens=v.gain_tokens,
        accrues_s=v.accrues_s,
        cost_tokens=v.cost_tokens,
        refill_s=cost.refill_s,
        gains=v.gains,
        savings=v.savings,
        worth=v.pays and v.trusted,
        replays=v.replays,
        reason=reason,
        refused=v.refused,
        measured_current=v.measured,
        undecided=v.pays and not v.trusted,
    )
    if v.why is not Why.WAITING_PAYS or v.waiting is None:
        return throughput
    quicker, base = v.waiting.quicker, v.base
    return replace(
        throughput,
        best=quicker,
        predicted_gain=quicker.output_tok_per_s / base - 1.0 if base > 0 else 0.0,
        gain_tokens=(quicker.output_tok_per_s - base) * settings.horizon_s,
        accrues_s=settings.horizon_s,
        worth=True,
        undecided=False,
        basis="waiting",
        wait_saved_s=v.waiting.saved_s,
        wait_cost_s=v.waiting.cost_s,
        utilization=v.waiting.utilization,
    )


ACTIVATION_MARGIN = 1.5  # the free memory a larger pool leaves: this x the twin's activations at least
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


@dataclass(frozen=True, slots=True)
class Looks:
    """What a worker's plans under its current arguments said, as its next plan and the controller read
    them; a restart starts them afresh (:meth:`after` folds in each new look).

    ``paying``: looks in a row that said a restart pays, none since saying it does not (a look inside the
    twin's error says neither and leaves the count); ``errors``: the twin's error on each look's requests,
    the newest ``ERROR_LOOKS - 1`` (:func:`twin_error`); ``gains``: the candidates' gains on the paying
    looks of the count (throughput basis), which the confirming look chooses on; ``savings``: the
    candidates' waiting saved on the newest ``ERROR_LOOKS - 1`` looks that asked the waiting basis, paying
    or not (:func:`_waiting_plan` weighs their mean); ``held_back``: the last look's restart paid but
    waited for another worker's (one restart at a time), so the worker is due its next look as soon as
    the fleet is whole again, not a whole ``plan_interval_s`` later."""

    paying: int = 0
    errors: tuple[float, ...] = ()
    gains: tuple[Mapping[str, float], ...] = ()
    savings: tuple[Mapping[str, float], ...] = ()
    held_back: bool = False

    def after(self, plan: Plan) -> Looks:
        """These looks and ``plan``'s (not yet held back: the controller says so when it is)."""
        errors = self.errors
        if plan.current_error is not None:
            errors = (*errors, plan.current_error)[-(ERROR_LOOKS - 1) :]
        savings = (*self.savings, plan.savings)[-(ERROR_LOOKS - 1) :] if plan.savings else self.savings
        if plan.undecided:
            return Looks(paying=self.paying, errors=errors, gains=self.gains, savings=savings)
        gains = (*self.gains, plan.gains)[-(ERROR_LOOKS - 1) :] if plan.worth and plan.basis == "throughput" else ()
        return Looks(paying=self.paying + 1 if plan.worth else 0, errors=errors, gains=gains, savings=savings)


def _no_worse(larger_pool: float, without: float, settings: PlanSettings) -> bool:
    """Whether the twin's figure for a candidate with the band's larger KV pool (tokens/s, or for the
    waiting basis the inverse: pass the answer times swapped) loses no more than the planner's noise
    floor (``min_gain``) against the same candidate without it. A restart takes the larger pool then:
    the band says where the pool belongs, and a few hundred replayed requests cannot tell a pool 2 %
    larger from the one it has (in three of nine retraction-storm hours the twin put 0.85, the best
    static arguments' fraction, a little below the restart's candidate on the window's requests, and the
    restart went without it; in a backlog of the same requests it is 1-6 % ahead)."""
    return larger_pool >= without * (1.0 - settings.min_gain)


def _capacity(twin: Twin, chosen: Prediction, loaded: Replay) -> float | None:
    """Output tokens/s the twin writes under ``chosen``'s args with the sample's own requests all
    waiting at once: what the worker can do on this work, the denominator of its utilization."""
    waiting = tuple(replace(sp, arrival=0.0) for sp in loaded.specs if sp.rid in loaded.foreground)
    if not waiting:
        return None
    most = twin.predict(chosen.args, Replay(waiting, loaded.foreground))
    return most.output_tok_per_s if most.oom is None and most.output_tok_per_s > 0 else None


def _roomier(twin: Twin, chosen: Prediction, loaded: Replay, settings: PlanSettings) -> Prediction | None:
    """``chosen`` (a candidate a restart is paid for) with the largest memory fraction whose free
    memory at start-up stays at the floor of the policy's band or above, and at ``ACTIVATION_MARGIN``
    x the activations the twin gives for a full prefill chunk and for the replay's largest decode
    batch past the CUDA graphs (the twin's memory model, on the grid of ``memory_fraction_step``'s
    multiples within the bounds), replayed: a larger KV pool the restart takes for free. The one-step
    memory candidates alone rarely pay a restart of their own (0.01 is 1-2 % more pool), so a
    fraction the band allows was left unused behind every other move. The margin: the twin's
    activations are presets, not measured (the perturbed premises' engine needs 25 % more), and a
    pool that leaves only what they say free dies on the first long prompt.
    None: no larger fraction keeps that free, or the twin would not start with it."""
    args = chosen.args
    try:
        now = twin.config(args)
    except SimConfigError:
        return None
    act = twin.activations(args)
    need_mib = 0.0
    if act is not None:
        chunk = prefill_chunk(now) or now.max_prefill_tokens
        past_graphs = chosen.peak_running if chosen.peak_running > act.graph_max_bs else 0
        need_mib = max(chunk * act.prefill_mib_per_token, past_graphs * act.decode_mib_per_seq)
    keep_gb = max(settings.min_available_gb, ACTIVATION_MARGIN * need_mib / 1024)
    step = settings.memory_fraction_step
    current = memory_fraction(now)
    _, top = settings.memory_fraction_bounds
    room: float | None = None
    frac = round((math.floor(current / step + 1e-9) + 1) * step, 3)  # the grid's next value above the current
    while frac <= top + 1e-9:
        try:
            free = twin.config({**args, twin.names.memory_fraction: frac}).memory.available_gb
        except SimConfigError:
            break
        if free < keep_gb:
            break
        room = frac
        frac = round(frac + step, 3)
    if room is None:
        return None
    p = twin.predict({**args, twin.names.memory_fraction: room}, loaded)
    if p.oom is not None or (p.available_gpu_mem_gb is not None and p.available_gpu_mem_gb < settings.min_available_gb):
        return None
    return p


def _band_fraction(twin: Twin, args: Mapping[str, object], settings: PlanSettings) -> dict[str, object] | None:
    """The candidate whose memory fraction leaves the middle of the free-memory band free at start-up
    (the twin's own memory model, on a grid of 0.01 within the bounds): one step to where the band
    says the pool belongs, where the one-step candidates would take many restarts to get there.
    None: no band top, the current args already inside the band, or no fraction lands in it."""
    if settings.max_available_gb is None:
        return None
    try:
        now_free = twin.config(args).memory.available_gb
    except SimConfigError:
        return None
    low, high = settings.min_available_gb, settings.max_available_gb
    if low <= now_free <= high:
        return None
    middle = (low + high) / 2
    flo, fhi = settings.memory_fraction_bounds
    best: tuple[float, float] | None = None  # (distance from the middle, fraction)
    for step in range(round(flo * 100), round(fhi * 100) + 1):
        frac = step / 100
        try:
            free = twin.config({**args, twin.names.memory_fraction: frac}).memory.available_gb
        except SimConfigError:
            continue
        if low <= free <= high and (best is None or abs(free - middle) < best[0]):
            best = (abs(free - middle), frac)
    return None if best is None else {**args, twin.names.memory_fraction: best[1]}


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


def _held_up(settings: PlanSettings) -> str:
    """What a waiting-basis reason adds of the requests held for the worker in the proxy's queue."""
    if settings.queued < 1:
        return ""
    return f" ({settings.queued:.0f} waiting for it in the proxy's queue among those it holds up)"


@dataclass(frozen=True, slots=True)
class WaitingPlan:
    """A restart for the waiting (:func:`_waiting_plan`): the candidate, the request-seconds of waiting
    it saves over the horizon (a mean over ``looks`` looks) and those the restart adds, at
    ``utilization`` (None: not known)."""

    quicker: Prediction
    saved_s: float
    cost_s: float
    utilization: float | None
    looks: int = 1
    this_look_s: float = 0.0  # what it saves on this look alone

    @property
    def over_looks(self) -> str:
        """What the reason says of the looks the saving is a mean over (nothing for one)."""
        return f" (a mean over {self.looks} looks; {self.this_look_s:.0f} on this one)" if self.looks > 1 else ""


def _arrivals(sample: Sequence[Observed]) -> tuple[float, float] | None:
    """The sample's arrival rate (requests/s) and the output tokens/s of its arrivals, over the span
    from its first arrival to its last; None: fewer than two, or all at one moment."""
    arrived = sorted(o.arrived for o in sample)
    span = arrived[-1] - arrived[0] if len(arrived) >= 2 else 0.0
    if span <= 0:
        return None
    return (len(arrived) - 1) / span, sum(o.output_tokens for o in sample) / span


def waiting_savings(
    current: Prediction,
    served: Sequence[Prediction],
    sample: Sequence[Observed],
    settings: PlanSettings,
    capacity: Callable[[Prediction], float | None] = lambda _: None,
) -> dict[str, float]:
    """The request-seconds of waiting each candidate that writes the same tokens (no fewer than the
    current args less ``min_gain``) saves over the horizon on this sample: its mean answer saved x the
    sample's arrival rate x the horizon (negative: it answers later). Empty where the waiting basis is
    not asked: no answer times to compare, or the sample arrived faster than the quickest of them
    writes it (``capacity``: output tokens/s with the sample all waiting; a batch submitted at once,
    whose "rate" x the horizon counts requests that never come)."""
    found = _arrivals(sample)
    if found is None or not current.mean_answer_s:
        return {}
    rate, output_rate = found
    floor = current.output_tok_per_s * (1.0 - settings.min_gain)
    same = [p for p in served if p.mean_answer_s is not None and p.output_tok_per_s >= floor]
    if not same:
        return {}
    most = capacity(min(same, key=lambda p: p.mean_answer_s or 0.0))
    if most and output_rate >= most:
        return {}
    return {
        args_key(p.args): (current.mean_answer_s - (p.mean_answer_s or 0.0)) * rate * settings.horizon_s for p in same
    }


def _waiting_plan(
    current: Prediction,
    served: Sequence[Prediction],
    sample: Sequence[Observed],
    in_flight: int,
    cost: RestartCost,
    settings: PlanSettings,
    savings: Mapping[str, float],
    earlier: Sequence[Mapping[str, float]] = (),
    capacity: Callable[[Prediction], float | None] = lambda _: None,
) -> WaitingPlan | None:
    """Where no candidate writes more tokens per second (arrivals the worker keeps up with), the
    candidate answering the same requests sooner by a real margin (``min_gain``) on this look whose
    waiting saved over the horizon (``savings``, :func:`waiting_savings`) is the most on average over
    this look and the ``earlier`` looks that asked the waiting basis (newest last, the last
    ``ERROR_LOOKS - 1``), with that mean, the request-seconds the restart adds
    (:func:`outage_waiting_s`: the outage is the drain, the start-up and the work computed again; the
    ``in_flight`` requests open on the worker and those ``settings.queued`` for it in the proxy wait it out), the
    utilization they were priced at (the sample's output per second of its arrivals over ``capacity``
    of the candidate; None: not known) and the looks the mean is over.

    The mean, not this look alone: under bursty arrivals the waiting a candidate saves comes in the
    bursts. In early-stop's bursty hour the looks that caught a burst read 260-311 request-seconds
    saved over the horizon against 208-246 the restart adds, the looks between them about none, and a
    restart taken on two such looks in a row lost 1.7 % of the hour's waiting: it paid 228
    request-seconds and saved 15 in the 1,200 modelled seconds after it.

    None: nothing to compare, no candidate sooner by the margin, no saving on average, or the sample
    arrived faster than the candidate serves it (utilization 1 or more: a backlog, which the throughput
    basis is for)."""
    found = _arrivals(sample)
    if found is None or current.mean_answer_s is None or not savings:
        return None
    rate, output_rate = found
    looks = [*earlier[-(ERROR_LOOKS - 1) :], savings]

    def over_looks(key: str) -> tuple[float, int]:
        seen = [look[key] for look in looks if key in look]
        return statistics.fmean(seen), len(seen)

    quicker, saved, count = current, 0.0, 0
    for p in served:  # sooner on this look by a real margin, the most saved over the looks
        key = args_key(p.args)
        if key not in savings or p.mean_answer_s is None:
            continue
        if p.mean_answer_s > current.mean_answer_s * (1.0 - settings.min_gain):
            continue
        mean, n = over_looks(key)
        if mean > saved:
            quicker, saved, count = p, mean, n
    if quicker is current:
        return None
    most = capacity(quicker)
    utilization = output_rate / most if most else None
    if utilization is not None and utilization >= 1.0:
        # the sample arrived faster than the candidate writes it (a batch submitted at once): the worker
        # does not keep up, the waiting is the throughput's, and its "rate" x the horizon counts requests
        # that will never come (shift's batch: 300 requests in a fraction of a second, utilization 517,
        # 1.4 million request-seconds "saved" over 60 s, and a restart that paid on nothing)
        return None
    outage = cost.outage_s(current.output_tok_per_s)
    paid = outage_waiting_s(in_flight + settings.queued, rate, outage, utilization)
    return WaitingPlan(quicker, saved, paid, utilization, count, savings[args_key(quicker.args)])


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """Everything one plan of one worker reads (collected on the event loop, planned off it)."""

    gpu: str
    model: str
    args: Mapping[str, object]
    resolved: Mapping[str, float]
    decode: tuple[DecodeStats, ...]
    kv_capacity_tokens: int | None
    workload: tuple[Observed, ...]
    cost: RestartCost
    settings: PlanSettings
    in_flight: tuple[InFlight, ...] = ()  # open on the worker at ``now``
    now: float | None = None
    looks: Looks = field(default_factory=Looks)  # what the earlier looks under these args said


def _sample(workload: Sequence[Observed], settings: PlanSettings) -> list[Observed]:
    return sorted(workload, key=lambda o: o.arrived)[-settings.max_requests :]


def run_plan(inputs: PlanInputs) -> Plan:
    """Calibrate the twin on the worker's signals, then plan (CPU-bound: a few bounded replays)."""
    loaded = replay(_sample(inputs.workload, inputs.settings), inputs.workload, inputs.in_flight, inputs.now)
    twin = calibrate(inputs.gpu, inputs.model, inputs.args, inputs.decode, inputs.kv_capacity_tokens, loaded)
    cost = inputs.cost
    if cost.refill_prompt_tokens > 0:
        cost = replace(
            cost, refill_s=twin.prefill_seconds(inputs.args, cost.refill_prompt_tokens, cost.refill_requests)
        )
    if cost.startup_s is None:  # no start of this worker seen: the twin's own start-up, on its calibrated clock
        try:
            cfg = twin.config(inputs.args)
            modelled = startup_seconds(cfg.weights_bytes, cfg.cuda_graph_max_bs_decode)[2]
            cost = replace(cost, startup_s=modelled * twin.step_time_factor)
        except SimConfigError:
            pass
    return plan(
        twin,
        inputs.args,
        inputs.workload,
        cost,
        inputs.settings,
        inputs.resolved,
        inputs.in_flight,
        inputs.now,
        inputs.looks.errors,
        inputs.looks.gains,
        inputs.looks.savings,
    )


@dataclass(frozen=True, slots=True)
class Expectation:
    """What an acted plan expects of the worker: its twin (calibrated under the old args) on the new
    args, judged on the plan's basis ("throughput": the sample's own tokens per second; "waiting":
    its mean answer time)."""

    twin: Twin
    args: Mapping[str, object]
    basis: str = "throughput"
    old_args: Mapping[str, object] | None = None  # the args the twin was calibrated under (None: no gain measured)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutcomeInputs:
    """What the check of an acted plan reads, once the worker has served under its new args."""

    expectation: Expectation
    workload: tuple[Observed, ...]  # the worker's newest answered requests
    since: float  # the outcome window opened here (same clock): only requests arrived since are judged
    in_flight: tuple[InFlight, ...] = ()  # open on the worker at ``now``
    now: float
    max_requests: int = 300
    ready: float | None = None  # the restart's worker was ready here: what it held ran on it from then at most


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """The plan's twin against the worker on the same requests, served under the new args."""

    basis: str
    predicted: float | None  # tokens/s or seconds, on the basis
    measured: float | None
    requests: int  # the requests judged
    throughput: float | None = None  # what the worker did in the window (tok/s, :meth:`Replay.measured`), any basis
    # the same figure of the twin under the old args, on the same requests: what the worker would have
    # done had it not restarted (the twin was calibrated there, and checked against it before acting)
    without: float | None = None
    # the mean answer time of the requests judged, the twin's and the worker's, any basis: a worker that
    # keeps up answers what arrives at any speed, twin and worker alike, and only its answer times
    # say how fast it was
    answer_predicted: float | None = None
    answer_measured: float | None = None

    @property
    def answer_error(self) -> float | None:
        """|predicted - measured| / measured mean answer time (None: not known)."""
        if self.answer_predicted is None or not self.answer_measured:
            return None
        return abs(self.answer_predicted - self.answer_measured) / self.answer_measured

    @property
    def gain(self) -> float | None:
        """What the new args gained on the traffic that came: the worker's throughput in the window
        over the twin's under the old args on the same requests, minus 1 (None: either is not known).
        Throughput before the restart against throughput after says as much about the traffic (its
        rate, its lengths, a burst's end) as about the args."""
        return self.throughput / self.without - 1.0 if self.throughput is not None and self.without else None

    @property
    def error(self) -> float | None:
        """|predicted - measured| / measured (None: nothing to judge)."""
        if self.predicted is None or not self.measured:
            return None
        return abs(self.predicted - self.measured) / self.measured


def check_outcome(inputs: OutcomeInputs) -> Outcome:
    """Replay what the worker did since the outcome window opened (the requests that arrived since,
    with the work then on it and the work open now) on the plan's twin under the new args, and set
    what it predicts against what the worker did: the twin's prediction for arguments it was not
    calibrated on, on traffic it had not seen, like with like. The traffic after a restart is never
    the one the plan replayed, so the plan's own figure against a window's throughput says as much
    about the traffic as about the twin. On the plan's basis: "throughput", the output of the
    requests answered in the window per second (:meth:`Replay.measured`, what the engine's counter of
    generated tokens reads: a twin too fast or too slow answers more or fewer of them by now);
    "waiting", the mean answer time of the requests that arrived since and were answered."""
    expect = inputs.expectation
    answered = [o for o in inputs.workload if o.arrived >= inputs.since and o.finished is not None]
    sample = sorted(answered, key=lambda o: o.arrived)[-inputs.max_requests :]
    loaded = replay(sample, inputs.workload, inputs.in_flight, inputs.now, start=inputs.since, began=inputs.ready)
    if loaded.until is None or (expect.basis == "waiting" and len(sample) < 2):
        return Outcome(basis=expect.basis, predicted=None, measured=None, requests=len(sample))
    p = expect.twin.predict(expect.args, loaded)
    throughput = loaded.measured()
    old = expect.twin.predict(expect.old_args, loaded) if expect.old_args is not None else None
    answer_s = statistics.fmean((o.finished or o.arrived) - o.arrived for o in sample) if len(sample) >= 2 else None
    if expect.basis == "waiting":
        measured, predicted = answer_s, p.mean_answer_s
    else:
        measured, predicted = throughput, p.answered_tok_per_s
    return Outcome(basis=expect.basis, predicted=predicted, measured=measured, requests=len(loaded.answered),
                   throughput=throughput, without=old.answered_tok_per_s if old is not None else None,
                   answer_predicted=p.mean_answer_s, answer_measured=answer_s)  # fmt: skip
