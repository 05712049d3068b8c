"""A worker's twin: the simulator's virtual-time core, calibrated to stand for one worker.

The twin is :func:`proxy.sim.virtual.simulate` under the presets of the worker's GPU and model (an
SGLang model), reached through the engine contract (the argument names its knobs move,
:class:`ArgNames`; the arguments its twin reads) and :mod:`proxy.sim.twin`. :meth:`Twin.predict`
replays a workload (:mod:`proxy.control.workload`) under given arguments into a :class:`Prediction`.

Calibration (:func:`calibrate`): the step time from the worker's own decode lines (the median of
expected over measured decode rate at the same batch; it absorbs a simulated worker's time scale),
the KV pool from its start-up line. A real GPU the simulator does not name starts from the
constants' presets and is calibrated the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.control.activations import Activations
from proxy.control.workload import Observed, Replay, replay
from proxy.engines.base import KnobName
from proxy.engines.contract import Engine
from proxy.sim.config import SimConfig, SimConfigError
from proxy.sim.memory import GRAPH_MIB_PER_BS
from proxy.sim.presets import GPUS, MIB
from proxy.sim.startup import capacity_line
from proxy.sim.twin import TWIN_ENGINE, graph_max_bs, memory_fraction, prefill_chunk, twin_config
from proxy.sim.virtual import simulate

__all__ = ["MIN_SPAN_LINES", "TWIN_NAMES", "ArgNames", "DecodeStats", "Prediction", "Twin", "calibrate"]


@dataclass(frozen=True, slots=True)
class ArgNames:
    """The names of the arguments the planner moves, as an engine's knobs name them."""

    conservativeness: str
    max_running: str
    prefill_chunk: str
    memory_fraction: str
    queue_order: str | None = None  # None: the engine has no such knob
    graph_max_bs: str | None = None

    @property
    def tuned(self) -> frozenset[str]:
        """Every argument the planner moves, as the engine names it."""
        names = (self.conservativeness, self.max_running, self.prefill_chunk, self.memory_fraction,
                 self.queue_order, self.graph_max_bs)  # fmt: skip
        return frozenset(n for n in names if n is not None)

    @classmethod
    def of(cls, engine: Engine) -> ArgNames:
        k = engine.knobs
        policy, graphs = k.get(KnobName.QUEUE_ORDER), k.get(KnobName.GRAPH_MAX_BS)
        return cls(
            conservativeness=k[KnobName.CONSERVATIVENESS].arg,
            max_running=k[KnobName.MAX_RUNNING].arg,
            prefill_chunk=k[KnobName.PREFILL_CHUNK].arg,
            memory_fraction=k[KnobName.MEMORY_FRACTION].arg,
            queue_order=policy.arg if policy is not None else None,
            graph_max_bs=graphs.arg if graphs is not None else None,
        )


TWIN_NAMES = ArgNames.of(TWIN_ENGINE)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeStats:
    """One decode-batch statistic of the worker: requests running, tokens they hold, tokens/s."""

    running: int
    used_tokens: int
    gen_throughput: float
    cuda_graph: bool = True
    at: float | None = None  # when the worker logged it, on the requests' clock (None: not known)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    args: Mapping[str, object]
    output_tok_per_s: float  # 0 when the twin would not start or dies of OOM
    mean_queue_s: float | None  # arrival to first token
    mean_answer_s: float | None = None  # arrival to the end of the answer (the sample's own, all of them answered)
    # what the worker is measured on (:meth:`Replay.measured`): the output of the requests answered
    # by the plan's moment, per second of the window; the sample alone (no window): its output over its
    # first arrival to its last answer (:func:`~proxy.control.workload.measured_throughput`). None: not
    # known, or it died
    answered_tok_per_s: float | None = None
    makespan_s: float
    retractions: int
    oom: str | None = None  # why it serves nothing: out of memory where, a refused start, a replay that stalled
    available_gpu_mem_gb: float | None = None
    peak_running: int = 0  # the largest running batch of the replay


@dataclass(frozen=True, slots=True)
class Twin:
    """One worker's model: the simulator's presets and this worker's correction factors."""

    gpu: str
    model: str
    step_time_factor: float = 1.0
    kv_factor: float = 1.0
    engine: Engine = TWIN_ENGINE  # the engine whose workers it models: the arguments it reads and moves
    # the requests the proxy's gate lets wait at the worker (its queue target): a replay's backlog waits
    # in front of the twin's engine, as it waits in the proxy. None: all of it at the engine. SGLang's
    # lpm sorts only a queue of 128 or fewer: which side of that the worker's queue is on decides it
    queue_cap: int | None = None
    gate_period_s: float = 0.0  # how often the gate looks at the worker's queue (its scrape period)
    # where the proxy's queue sorts by prefix: how often it passes over its oldest request (0: arrival order)
    prefix_first: int = 0

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
                           graph_max_bs=graph_max_bs(cfg), pool_tokens=cfg.memory.max_total_num_tokens,
                           model=f"{self.model} on {self.gpu}", pool_mib=cfg.memory.kv_pool_mib,
                           graph_mib_per_bs=GRAPH_MIB_PER_BS, total_mib=cfg.memory.total_mib,
                           devices=cfg.tp_size)  # fmt: skip

    def resolved(self, args: Mapping[str, object]) -> dict[str, float]:
        """What the twin's engine chooses under ``args`` for an unset argument its start-up line does not
        print (the memory fraction), keyed as the engine's knob reads it: the forecast's resolved values."""
        knob = self.engine.knobs.get(KnobName.MEMORY_FRACTION)
        if knob is None or knob.resolved_field is None:
            return {}
        try:
            return {knob.resolved_field: memory_fraction(self.config(args))}
        except SimConfigError:
            return {}

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
        the replay has a window or goes on (:func:`~proxy.control.workload.continued`), else the sample's
        own (its output tokens over first arrival to last answer); ``answered_tok_per_s`` is the window's
        (:meth:`Replay.measured`)."""
        try:
            cfg = self.config(args)
        except SimConfigError as exc:
            return Prediction(args=dict(args), output_tok_per_s=0.0, mean_queue_s=None, makespan_s=0.0,
                              retractions=0, oom=f"startup: {exc}")  # fmt: skip
        plan_replay = workload if isinstance(workload, Replay) else replay(workload)
        res = simulate(
            cfg,
            list(plan_replay.specs),
            queue_cap=self.queue_cap,
            gate_period_s=self.gate_period_s,
            prefix_first=self.prefix_first,
        )
        failed = res.oom or (f"stalled: {res.stalled}" if res.stalled else None)
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
            answered_tok_per_s=None if failed else mine,
            output_tok_per_s=0.0 if failed else tp,
            mean_queue_s=sum(waits) / len(waits) if waits else None,
            peak_running=max((p.running for p in res.trace), default=0),
            mean_answer_s=sum(answers) / len(answers) if answers and len(answers) == len(own) and not failed else None,
            makespan_s=res.makespan_s,
            retractions=res.retractions,
            oom=failed,
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
