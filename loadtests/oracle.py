"""The oracle's arguments: the best static SGLang arguments for one workload, by a sweep in virtual time.

    result = sweep(start_args, workload, gpu="h100-80gb", model="llama-3.1-8b", space=SearchSpace())
    result.best.args, result.best.output_tok_per_s, result.trials

Every trial runs the whole workload through :func:`proxy.sim.virtual.simulate`: the same
scheduler, memory and step-time model as the ``pacer sim`` server, without sockets or sleeping
(a few hundred milliseconds of CPU per trial). A trial scores its output tokens per modelled
second; a server that dies of an out-of-memory error, or that would not start, scores zero.

The search is coordinate descent over the four knobs the controller can move
(``schedule_conservativeness``, ``chunked_prefill_size``, ``max_running_requests``,
``mem_fraction_static``): starting from the scenario's arguments, each knob in turn is swept over
its candidate values with the others held at the best found so far; ``passes`` rounds of that.

The space is the one the deployment allows: arguments that leave less free device memory at
start-up than ``min_available_gb`` (the floor of the policy's ``available_mem_band_gb``, the tuning
guide's OOM risk line) are not candidates, so the oracle is the best *safe* static configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from proxy.engines.sglang.argv import build_argv
from proxy.sim.cli import build_parser
from proxy.sim.config import SimConfig, SimConfigError, resolve_config
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate

__all__ = ["SearchSpace", "SweepResult", "Trial", "evaluate", "sim_config", "sweep"]

KNOBS = ("schedule_conservativeness", "chunked_prefill_size", "max_running_requests", "mem_fraction_static")


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """Candidate values per knob (``None``: leave the argument unset, SGLang's default)."""

    schedule_conservativeness: tuple[float | None, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.3, 1.6, 2.0)
    chunked_prefill_size: tuple[int | None, ...] = (None, 1024, 2048, 4096, 8192, 16384)
    max_running_requests: tuple[int | None, ...] = (None, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    mem_fraction_static: tuple[float | None, ...] = (None, 0.6, 0.7, 0.75, 0.8, 0.83, 0.85, 0.87, 0.89, 0.91, 0.93)
    min_available_gb: float = 0.0  # safety floor on start-up free memory
    passes: int = 2

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

    @property
    def score(self) -> float:
        return 0.0 if self.oom is not None or self.unsafe else self.output_tok_per_s

    def as_dict(self) -> dict[str, Any]:
        return {"args": dict(self.args), "output_tok_per_s": round(self.output_tok_per_s, 1),
                "makespan_s": round(self.makespan_s, 2), "retractions": self.retractions, "oom": self.oom,
                "available_gpu_mem_gb": None if self.available_gpu_mem_gb is None else round(self.available_gpu_mem_gb, 2),
                "unsafe": self.unsafe}


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    start: Trial  # the scenario's own arguments
    best: Trial
    trials: tuple[Trial, ...] = field(default_factory=tuple)


def sim_config(args: Mapping[str, Any], *, gpu: str, model: str, time_scale: float = 1.0) -> SimConfig:
    """The resolved config a ``pacer sim`` started with these SGLang args would run with."""
    argv = build_argv({k: v for k, v in args.items() if v is not None}, ["--sim-gpu", gpu, "--sim-model", model,
                      "--sim-time-scale", str(time_scale)], host="127.0.0.1", port=0)
    return resolve_config(build_parser().parse_args(argv))


def evaluate(args: Mapping[str, Any], workload: Sequence[RequestSpec], *, gpu: str, model: str,
             min_available_gb: float = 0.0) -> Trial:
    try:
        cfg = sim_config(args, gpu=gpu, model=model)
    except SimConfigError:
        return Trial(args=dict(args), output_tok_per_s=0.0, oom="startup")
    free = cfg.memory.available_gb
    if free < min_available_gb:
        return Trial(args=dict(args), output_tok_per_s=0.0, available_gpu_mem_gb=free, unsafe=True)
    res = simulate(cfg, workload)
    return Trial(args=dict(args), output_tok_per_s=0.0 if res.oom else res.output_tok_per_s, makespan_s=res.makespan_s,
                 retractions=res.retractions, oom=res.oom, available_gpu_mem_gb=free)


def sweep(start_args: Mapping[str, Any], workload: Sequence[RequestSpec], *, gpu: str, model: str,
          space: SearchSpace | None = None) -> SweepResult:
    space = space or SearchSpace()
    seen: dict[tuple[Any, ...], Trial] = {}

    def trial(args: Mapping[str, Any]) -> Trial:
        key = tuple(sorted((k, v) for k, v in args.items() if v is not None))
        if key not in seen:
            seen[key] = evaluate(args, workload, gpu=gpu, model=model, min_available_gb=space.min_available_gb)
        return seen[key]

    start = trial(dict(start_args))
    best = start
    for _ in range(space.passes):
        before = best
        for knob in KNOBS:
            for value in space.values(knob):
                t = trial({**best.args, knob: value})
                if t.score > best.score * 1.001:  # a real gain, not a rounding tie
                    best = t
        if best is before:
            break
    return SweepResult(start=start, best=best, trials=tuple(seen.values()))
