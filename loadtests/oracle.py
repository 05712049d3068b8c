"""The oracle's arguments: the best static SGLang arguments for one workload, by a sweep in virtual time.

    result = sweep(start_args, workload, gpu="h100-80gb", model="llama-3.1-8b", space=SearchSpace())
    result.best.args, result.best.output_tok_per_s, result.trials

Every trial runs the whole workload through :func:`proxy.sim.virtual.simulate`: the same
scheduler, memory and step-time model as the ``pacer sim`` server, without sockets or sleeping
(a few hundred milliseconds of CPU per trial). A trial scores its output tokens per modelled
second (a backlogged run), or on the mean time from a request's arrival to its answer (``objective =
"answer_time"``: a run that arrives over time, where every argument that keeps up delivers the same
tokens per second); a server that dies of an out-of-memory error, or that would not start, scores zero.

The search is coordinate descent over the knobs the controller can move
(``schedule_conservativeness``, ``chunked_prefill_size``, ``max_running_requests``,
``mem_fraction_static``, and where the space gives values ``schedule_policy`` and
``cuda_graph_max_bs_decode``): starting from the scenario's arguments, each knob in turn is swept over
its candidate values with the others held at the best found so far, then every running cap at the
fractions nearest the best's (the two share the free memory); ``passes`` rounds of that.

Arrival: every arm runs behind the proxy, whose pacing gate feeds the worker only while its estimated
server queue is under the band's target (``queue_band[0] + headroom``), from a scrape every
``scrape_interval_s`` of the engine's time (the scraper's wall floor aside). A trial replays that
gate (:class:`Pacing`, :func:`simulate_paced`): the same engine, fed the way the live arms feed it. Queuing the whole workload at the engine at
once (``pacing=None``, :func:`proxy.sim.virtual.simulate`) is a different arrival process, and the
engine's admission depends on it: with 8,000 requests waiting, retractions reset the new-token
ratio before the running batch grows large, while behind the proxy (about 130 waiting) the ratio
decays further between retractions and the batch grows past what the same arguments survived in
the queued replay (decode-oom: conservativeness 0.7 ran clean queued and died of a decode OOM live).

The space is the one the deployment allows: arguments that leave less free device memory at
start-up than ``min_available_gb`` (the floor of the policy's ``available_mem_band_gb``, the tuning
guide's OOM risk line) are not candidates, so the oracle is the best *safe* static configuration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.engines.base import Sample
from proxy.engines.sglang.argv import build_argv
from proxy.engines.sglang.engine import SIM
from proxy.observe.scraper import MIN_WALL_INTERVAL_S
from proxy.request.pacing import Band, WorkerLoad
from proxy.sim.cli import build_parser
from proxy.sim.config import SimConfig, SimConfigError, resolve_config
from proxy.sim.engine import Engine
from proxy.sim.prefix_first import PrefixFirst, prefix_group
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate

__all__ = [
    "LEVER_VALUES",
    "PacedResult",
    "Pacing",
    "Restart",
    "SearchSpace",
    "SweepResult",
    "Trial",
    "evaluate",
    "paired_args",
    "prefix_limit",
    "sim_config",
    "simulate_paced",
    "sweep",
]

KNOBS = (
    "schedule_conservativeness",
    "chunked_prefill_size",
    "max_running_requests",
    "mem_fraction_static",
    "schedule_policy",
    "cuda_graph_max_bs_decode",
)
# the tuning guide's other two levers as the scenarios sweep them (a space's own default: not swept)
LEVER_VALUES: dict[str, tuple[Any, ...]] = {
    "schedule_policy": (None, "lpm", "fcfs"),
    "cuda_graph_max_bs_decode": (None, 160, 256, 512, 768, 1024),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Pacing:
    """The proxy's pacing gate as the engine sees it: the policy's :class:`~proxy.request.pacing.Band` and the
    dispatcher's estimate of the server queue (:class:`~proxy.request.pacing.WorkerLoad`, the same code,
    driven here in virtual time), with a scrape every ``scrape_s`` engine seconds (the policy's
    ``scrape_interval_s``, in the engine's seconds, or the scraper's wall floor at the time scale)."""

    band: Band = field(default_factory=lambda: Band(lo=100, hi=400, headroom=32))
    scrape_s: float = 5.0

    @property
    def target(self) -> int:
        return self.band.target

    @classmethod
    def of(cls, band: Band, scrape_interval_s: float, time_scale: float) -> Pacing:
        return cls(band=band, scrape_s=max(scrape_interval_s, MIN_WALL_INTERVAL_S * time_scale))


@dataclass(frozen=True, slots=True)
class PacedResult:
    output_tokens: int
    makespan_s: float
    output_tok_per_s: float
    retractions: int
    finished: int
    oom: str | None
    peak_running: int
    peak_activation_fraction: float = 0.0  # the largest step's activations / the free memory at start-up
    peak_decode_fraction: float = 0.0  # the same, of the decode steps
    mean_answer_s: float = 0.0  # mean engine seconds from a request's arrival to its answer (the finished ones)
    # per workload request (its index), engine seconds from its arrival to its answer; NaN: not answered
    answer_s: tuple[float, ...] = field(default=(), repr=False)


def _prompt_ids(spec: RequestSpec, index: int) -> tuple[int, ...]:
    if spec.prompt_ids is not None:
        return tuple(spec.prompt_ids)
    base = -(index + 1) * 10_000_000  # unique per request: no shared prefix
    return tuple(range(base, base + max(1, spec.prompt_len)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """One restart in a paced replay: at ``at_s`` engine seconds the worker stops, everything it had not
    finished goes back to the front of the proxy's queue (non-streamed requests: their progress is
    lost, as in a live take-back), and after ``startup_s`` a worker with ``config`` serves the rest.
    A worker that dies of an out-of-memory error before ``at_s`` restarts when it dies."""

    at_s: float
    config: SimConfig
    startup_s: float


def prefix_limit(config: SimConfig) -> int | None:
    """The queue a worker started with ``config`` orders by prefix, at most (None: it does not)."""
    return SIM.prefix_queue_limit({"schedule_policy": config.schedule_policy})


def _load(config: SimConfig) -> WorkerLoad:
    """The gate's record of a worker started with ``config``: its queue kept at its prefix limit, as
    the dispatcher keeps it (``WorkerLoad.queue_sides``)."""
    load = WorkerLoad("replay")
    load.prefix_limit = prefix_limit(config)
    return load


def simulate_paced(
    config: SimConfig,
    workload: Sequence[RequestSpec],
    pacing: Pacing,
    restart: Restart | None = None,
    hold: int | None = None,
    queue_past: bool = False,
) -> PacedResult:
    """The workload submitted to the proxy as it arrives (each request's ``arrival``, engine seconds; all at
    0 for a batch job), fed to one engine through the pacing gate, in virtual time: the live arms'
    arrival process. With ``restart``, the same run with one restart of the worker under new arguments
    (what a controller's move costs); with ``hold``, the gate holds the requests open on the worker at
    that many; with ``queue_past``, the gate keeps an lpm worker's queue past its prefix limit (until
    a restart, as the dispatcher does). Each answer's time from its arrival is kept
    (``mean_answer_s``): a run that arrives over time is judged on it."""
    room = hold if hold is not None else len(workload) + 1
    eng = Engine(config)
    load = _load(config)  # the dispatcher's per-worker counts and estimate
    load.queue_past = queue_past
    # what waits in the proxy, in its order: arrival (ties in submission order), or where the engine sorts
    # by prefix the proxy's queue sorts its own too (the pool's prefix limit as the proxy started it)
    pending = PrefixFirst(lambda i: prefix_group(workload[i]), load.prefix_limit or 0)
    pending.add(sorted(range(len(workload)), key=lambda i: (workload[i].arrival, i)))
    on_worker: dict[str, int] = {}  # rid -> index of what the worker holds
    t = 0.0
    next_scrape = 0.0
    out_tokens = finished = peak = retracted = 0
    answered = [math.nan] * len(workload)
    need = decode_need = 0.0
    oom: str | None = None

    def arrived(i: int) -> bool:
        return workload[i].arrival <= t

    while True:
        if restart is not None and t >= restart.at_s:
            taken_back = sorted(on_worker.values(), key=lambda i: (workload[i].arrival, i))
            for i in taken_back:
                pending.ended(i, answered=False)
            pending.add(taken_back, front=True)  # taken back, in their order, first
            on_worker.clear()
            retracted += eng.retracted_total
            eng, load, config = Engine(restart.config), _load(restart.config), restart.config
            t += restart.startup_s
            next_scrape, restart = t, None
        if t >= next_scrape:
            load.scrape_started()
            load.record(Sample(time=t, queue=len(eng.waiting), running=eng.n_run, token_usage=0.0))
            next_scrape = t + pacing.scrape_s
        while (
            (head := pending.head()) is not None
            and arrived(head)
            and load.est_queue() < load.target(pacing.band)
            and load.in_flight < room
        ):
            i = pending.take(arrived)
            spec = workload[i]
            req = eng.add(
                prompt_ids=_prompt_ids(spec, i),
                max_new_tokens=spec.max_new_tokens,
                ignore_eos=spec.ignore_eos,
                output_len=spec.output_len,
                rid=spec.rid,
                now=t,
            )
            on_worker[req.rid] = i
            load.reserve(req.rid)  # type: ignore[arg-type]  # the rid stands for the attempt: one key per request
        step = eng.plan(t)
        if step is None:
            if head is None and load.in_flight == 0:
                break
            wake = next_scrape  # idle until the next look, the next arrival or the restart
            if head is not None and workload[head].arrival > t:
                wake = min(wake, workload[head].arrival)
            t = wake if restart is None else min(wake, max(restart.at_s, t))
            continue
        if step.oom is not None:
            if restart is not None:  # the worker dies here: that is its restart
                restart = replace(restart, at_s=t)
                continue
            oom = step.oom
            break
        need = max(need, step.need_mib)
        if step.kind == "decode":
            decode_need = max(decode_need, step.need_mib)
        t += step.duration
        outcome = eng.complete(step, t)
        peak = max(peak, eng.n_run)
        for r in outcome.finished:
            out_tokens += eng.output_len(r)
            i = on_worker.pop(r.rid, -1)
            if i >= 0:
                answered[i] = t - workload[i].arrival
                pending.ended(i, answered=True)
            load.release(r.rid)  # type: ignore[arg-type]
        finished += len(outcome.finished)
    return PacedResult(
        output_tokens=out_tokens,
        makespan_s=t,
        output_tok_per_s=out_tokens / t if t > 0 else 0.0,
        retractions=retracted + eng.retracted_total,
        finished=finished,
        oom=oom,
        peak_running=peak,
        peak_activation_fraction=need / config.memory.available_mib if config.memory.available_mib > 0 else 0.0,
        peak_decode_fraction=decode_need / config.memory.available_mib if config.memory.available_mib > 0 else 0.0,
        mean_answer_s=math.fsum(a for a in answered if not math.isnan(a)) / finished if finished else 0.0,
        answer_s=tuple(answered),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """Candidate values per knob (``None``: leave the argument unset, SGLang's default)."""

    schedule_conservativeness: tuple[float | None, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3, 1.6, 2.0)
    chunked_prefill_size: tuple[int | None, ...] = (None, 1024, 2048, 4096, 8192, 16384)
    max_running_requests: tuple[int | None, ...] = (None, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    mem_fraction_static: tuple[float | None, ...] = (None, 0.6, 0.7, 0.75, 0.8, 0.83, 0.85, 0.87, 0.89, 0.91, 0.93)
    # the guide's schedule policy and CUDA-graph batch size: only the start's own unless given
    # (:data:`LEVER_VALUES`: what the scenarios sweep)
    schedule_policy: tuple[str | None, ...] = (None,)
    cuda_graph_max_bs_decode: tuple[int | None, ...] = (None,)
    min_available_gb: float = 0.0  # safety floor on start-up free memory
    passes: int = 2
    # what a trial is scored on: "throughput" (output tokens per modelled second: a backlogged run) or
    # "answer_time" (the mean time from a request's arrival to its answer, shorter is better: a run
    # that arrives over time slower than the best arguments serve it, where every argument that keeps
    # up delivers the same tokens per second and only the waiting differs)
    objective: str = "throughput"
    pacing: Pacing | None = None  # the proxy's gate in front of the engine (None: the workload queued at once)
    # paced trials: the largest step's activations may take at most this share of the free memory.
    # A replay is not the live arm to the request: decode-oom's conservativeness 1.6 peaked at 97.6 %
    # of the free memory in the paced replay and died of a decode OOM live; a knife edge is not safe
    max_activation_fraction: float = 0.9
    # and a decode batch at most this share: live, the batch runs past the replay's (the gate's scrapes
    # lag, a prefill adds many at once). decode-oom's best at 0.898 of the free memory in the replay
    # died live in one of two runs; 0.8 is the controller's own margin (decode_oom_factor)
    max_decode_fraction: float = 0.8

    def values(self, knob: str) -> tuple[Any, ...]:
        return tuple(getattr(self, knob))


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    args: Mapping[str, Any]
    output_tok_per_s: float  # per modelled second; 0 when it crashed or could not start
    makespan_s: float = 0.0
    retractions: int = 0
    oom: str | None = None  # "prefill" | "decode" | "startup" (would not start)
    available_gpu_mem_gb: float | None = None
    unsafe: bool = False  # under the free-memory floor: not a candidate
    mean_answer_s: float = 0.0  # mean modelled seconds from arrival to answer
    objective: str = "throughput"  # what :attr:`score` is (see :class:`SearchSpace`)

    @property
    def score(self) -> float:
        """Higher is better: output tokens per second, or answers per second of waiting (1 / the mean time
        from arrival to answer); 0 for a trial that crashed, could not start or is not a candidate."""
        if self.oom is not None or self.unsafe:
            return 0.0
        if self.objective == "answer_time":
            return 1.0 / self.mean_answer_s if self.mean_answer_s > 0 else 0.0
        return self.output_tok_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "args": dict(self.args),
            "output_tok_per_s": round(self.output_tok_per_s, 1),
            "makespan_s": round(self.makespan_s, 2),
            "retractions": self.retractions,
            "oom": self.oom,
            "available_gpu_mem_gb": None if self.available_gpu_mem_gb is None else round(self.available_gpu_mem_gb, 2),
            "unsafe": self.unsafe,
            "mean_answer_s": round(self.mean_answer_s, 3),
            "objective": self.objective,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    start: Trial  # the scenario's own arguments
    best: Trial
    trials: tuple[Trial, ...] = field(default_factory=tuple)


def sim_config(
    args: Mapping[str, Any], *, gpu: str, model: str, time_scale: float = 1.0, perturb: Sequence[str] = ()
) -> SimConfig:
    """The resolved config a ``pacer sim`` started with these SGLang args would run with (``perturb``:
    the simulator's hidden perturbation flags, the engine the arms really run)."""
    argv = build_argv(
        {k: v for k, v in args.items() if v is not None},
        ["--sim-gpu", gpu, "--sim-model", model, "--sim-time-scale", str(time_scale), *perturb],
        host="127.0.0.1",
        port=0,
    )
    return resolve_config(build_parser().parse_args(argv))


def evaluate(
    args: Mapping[str, Any],
    workload: Sequence[RequestSpec],
    *,
    gpu: str,
    model: str,
    min_available_gb: float = 0.0,
    pacing: Pacing | None = None,
    max_activation_fraction: float = 1.0,
    max_decode_fraction: float = 1.0,
    perturb: Sequence[str] = (),
    objective: str = "throughput",
) -> Trial:
    try:
        cfg = sim_config(args, gpu=gpu, model=model, perturb=perturb)
    except SimConfigError:
        return Trial(args=dict(args), output_tok_per_s=0.0, oom="startup", objective=objective)
    free = cfg.memory.available_gb
    if free < min_available_gb:
        return Trial(args=dict(args), output_tok_per_s=0.0, available_gpu_mem_gb=free, unsafe=True, objective=objective)
    res = simulate(cfg, workload) if pacing is None else simulate_paced(cfg, workload, pacing)
    edge = (
        isinstance(res, PacedResult)
        and res.oom is None
        and (res.peak_activation_fraction > max_activation_fraction or res.peak_decode_fraction > max_decode_fraction)
    )
    if isinstance(res, PacedResult):
        mean_answer = res.mean_answer_s
    else:
        waits = [r.finish_time - r.arrival for r in res.requests if r.finish_time is not None]
        mean_answer = sum(waits) / len(waits) if waits else 0.0
    return Trial(
        mean_answer_s=mean_answer,
        objective=objective,
        args=dict(args),
        output_tok_per_s=0.0 if res.oom else res.output_tok_per_s,
        makespan_s=res.makespan_s,
        retractions=res.retractions,
        oom=res.oom,
        available_gpu_mem_gb=free,
        unsafe=edge,
    )


def sweep(
    start_args: Mapping[str, Any],
    workload: Sequence[RequestSpec],
    *,
    gpu: str,
    model: str,
    space: SearchSpace | None = None,
    perturb: Sequence[str] = (),
) -> SweepResult:
    space = space or SearchSpace()
    seen: dict[tuple[Any, ...], Trial] = {}

    def trial(args: Mapping[str, Any]) -> Trial:
        key = tuple(sorted((k, v) for k, v in args.items() if v is not None))
        if key not in seen:
            seen[key] = evaluate(
                args,
                workload,
                gpu=gpu,
                model=model,
                min_available_gb=space.min_available_gb,
                pacing=space.pacing,
                max_activation_fraction=space.max_activation_fraction,
                max_decode_fraction=space.max_decode_fraction,
                perturb=perturb,
                objective=space.objective,
            )
        return seen[key]

    def better(t: Trial, than: Trial) -> bool:
        return t.score > than.score * 1.001  # a real gain, not a rounding tie

    start = trial(dict(start_args))
    best = start
    for _ in range(space.passes):
        before = best
        for knob in KNOBS:
            for value in space.values(knob):
                t = trial({**best.args, knob: value})
                if better(t, best):
                    best = t
        # the memory fraction and the running cap share the free memory: a cap the activations bound at
        # one fraction is free at a smaller one, which one knob at a time does not reach (neither move
        # gains alone). Each cap at the fractions nearest the best's
        resolved = sim_config(best.args, gpu=gpu, model=model, perturb=perturb).mem_fraction_static
        for args in paired_args(best.args, space, resolved):
            t = trial(args)
            if better(t, best):
                best = t
        if best is before:
            break
    return SweepResult(start=start, best=best, trials=tuple(seen.values()))


PAIRED_FRACTIONS = 3  # the fractions nearest the best's that the paired step tries every cap at


def paired_args(args: Mapping[str, Any], space: SearchSpace, resolved: float) -> list[dict[str, Any]]:
    """Every running cap of the space at each of the :data:`PAIRED_FRACTIONS` fractions of the space
    nearest the one ``args`` run at (``resolved``: the engine's own where ``args`` leave it unset), the
    other arguments as in ``args``."""
    fractions = [f for f in space.mem_fraction_static if f is not None]
    nearest = sorted(fractions, key=lambda f: (abs(f - resolved), -f))[:PAIRED_FRACTIONS]
    return [
        {**args, "mem_fraction_static": f, "max_running_requests": cap}
        for f in nearest
        for cap in space.max_running_requests
    ]
