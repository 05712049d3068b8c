"""Data against tensor parallelism: a pool's GPUs as one shape (workers x tp) against the others.

A pool of ``G`` GPUs can run ``G / tp`` replicas of tensor parallel ``tp`` for each ``tp`` of 1, 2, 4
or 8 that divides ``G`` (:func:`shapes_for`). :func:`compare_shapes` prices each shape with the
pool's twin (the simulator models ``tp``: the weights and KV pool split over the GPUs, the
collectives each step costs, :mod:`proxy.sim.steptime`) on the pool's own recent requests:

* a shape's workers run the current worker's arguments with the engine's flags for their tp, a cap
  on running requests or KV tokens kept per GPU (:func:`shape_args`);
* a shape fits when its worker starts (weights and activations fit) and its KV pool holds at least
  ``MIN_POOL_REQUESTS`` of the largest requests seen (a smaller pool retracts without end);
* its throughput is saturated throughput, since a shape matters only while work waits: the recent
  requests, in their order, dealt to the replicas one after another (the proxy's dispatch sends each
  request to the least loaded of equal replicas, so each gets every ``n``-th) and waiting at once,
  ``SATURATE`` times what one replica runs at once (its running cap, or what its KV pool holds);
  the output written between ``WARM_FRACTION`` of the time its last request waited and then, per
  second, times the replicas (equal replicas on equal shares do the same: one is replayed).

The comparison names the best shape and its gain over the current one; the controller journals it and,
where the pool's policy allows it, reshapes the pool (:mod:`proxy.control.reshaping`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.control.twin import Twin
from proxy.control.workload import Observed
from proxy.sim.config import SimConfigError
from proxy.sim.request import RequestSpec
from proxy.sim.twin import CAPACITY_ARGS, running_cap
from proxy.sim.virtual import SimResult, simulate

__all__ = [
    "Shape",
    "ShapeComparison",
    "ShapeResult",
    "compare_shapes",
    "saturated_throughput",
    "shape_args",
    "shapes_for",
]

TP_SIZES = (1, 2, 4, 8)  # what SGLang runs a Llama at (its heads divide by them) and the simulator models
MIN_POOL_REQUESTS = 8  # a shape's KV pool holds at least this many of the largest requests seen
SATURATE = 2  # requests waiting per replica: this x what it runs at once
MAX_REPLAYED = 6000  # requests replayed per shape at most (CPU: a tp-8 pool runs thousands at once)
WARM_FRACTION = 0.25  # the replay's first part, while the batch fills, is left out


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """``workers`` replicas of tensor parallel ``tp``."""

    tp: int
    workers: int

    @property
    def gpus(self) -> int:
        return self.tp * self.workers

    def __str__(self) -> str:
        return f"{self.workers} x tp {self.tp}"


def shapes_for(gpus: int, tp_sizes: Sequence[int] = TP_SIZES) -> list[Shape]:
    """Every shape of ``gpus`` GPUs: one per tensor parallel size that divides them."""
    return [Shape(tp, gpus // tp) for tp in tp_sizes if tp <= gpus and gpus % tp == 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeResult:
    shape: Shape
    output_tok_per_s: float  # the pool's saturated throughput in this shape (0: it does not fit)
    kv_tokens: int = 0  # one replica's KV pool
    running: int = 0  # what one replica runs at once in the replay (its peak)
    unfit: str | None = None  # why the shape does not fit

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"shape": str(self.shape), "tp": self.shape.tp, "workers": self.shape.workers,
                                  "predicted_throughput": round(self.output_tok_per_s, 1)}  # fmt: skip
        if self.unfit is not None:
            out["unfit"] = self.unfit
        else:
            out.update(kv_tokens=self.kv_tokens, running=self.running)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeComparison:
    current: ShapeResult
    results: tuple[ShapeResult, ...]  # every shape, the current among them
    best: ShapeResult  # ``current`` when none beats it
    replayed_requests: int

    @property
    def gain(self) -> float:
        """The best shape's throughput over the current one's, less 1 (0: the current is best)."""
        now = self.current.output_tok_per_s
        return self.best.output_tok_per_s / now - 1.0 if now > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "current_shape": str(self.current.shape),
            "best_shape": str(self.best.shape),
            "predicted_gain": round(self.gain, 4),
            "shapes": [r.to_json() for r in self.results],
            "replayed_requests": self.replayed_requests,
        }


def shape_args(
    args: Mapping[str, object], old_tp: int, new_tp: int, tp_args: Mapping[str, object]
) -> dict[str, object]:
    """A worker's arguments in another shape: its own, with the engine's placement flags for the new tp,
    and the capacity its arguments cap (running requests, KV tokens) scaled to the new tp: the same
    per GPU (a cap set for a tp-8 worker's eight GPUs is an eighth of it for one GPU)."""
    out = {**args, **tp_args}
    for name in CAPACITY_ARGS:
        value = args.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = max(1, round(value * new_tp / old_tp))
    return out


def _written_between(res: SimResult, start: float, end: float) -> float:
    """Output tokens written in ``[start, end]``, each request's at an even pace from its first token
    to its end."""
    total = 0.0
    for r in res.requests:
        if r.first_token_time is None or r.output_tokens <= 0:
            continue
        finish = r.finish_time if r.finish_time is not None else res.makespan_s
        span = finish - r.first_token_time
        if span <= 0:
            total += r.output_tokens if start <= finish <= end else 0.0
            continue
        overlap = min(end, finish) - max(start, r.first_token_time)
        total += r.output_tokens * max(0.0, overlap) / span
    return total


def saturated_throughput(res: SimResult) -> float:
    """Output tokens per second while requests waited: from ``WARM_FRACTION`` of the time the last
    request got its first token to then (the whole replay where that is not known)."""
    firsts = [r.first_token_time for r in res.requests if r.first_token_time is not None]
    if res.oom or not firsts:
        return 0.0
    end = max(firsts)
    start = WARM_FRACTION * end
    if end - start <= 0:
        return res.output_tok_per_s
    return _written_between(res, start, end) / (end - start)


def _specs(sample: Sequence[Observed], shape: Shape, count: int) -> list[RequestSpec]:
    """One replica's share of the sample (every ``workers``-th request), cycled to ``count``, waiting at 0."""
    share = [o.here for o in sample[:: shape.workers]] or [o.here for o in sample]
    out = []
    for i in range(count):
        spec = share[i % len(share)]
        out.append(RequestSpec(arrival=0.0, prompt_len=spec.prompt_len, max_new_tokens=spec.max_new_tokens,
                               output_len=spec.output_len, rid=f"r{i}"))  # fmt: skip
    return out


def price_shape(twin: Twin, args: Mapping[str, object], sample: Sequence[Observed], shape: Shape) -> ShapeResult:
    """One shape's saturated throughput on the sample (0 with why where it does not fit)."""
    try:
        cfg = twin.config(args)
    except SimConfigError as exc:
        return ShapeResult(shape=shape, output_tok_per_s=0.0, unfit=f"it does not start: {exc}")
    largest = max(o.here.prompt_len + o.here.max_new_tokens for o in sample)
    if cfg.max_total_num_tokens < MIN_POOL_REQUESTS * largest:
        return ShapeResult(shape=shape, output_tok_per_s=0.0, kv_tokens=cfg.max_total_num_tokens,
                           unfit=f"its KV pool ({cfg.max_total_num_tokens} tokens) holds under "
                                 f"{MIN_POOL_REQUESTS} of the largest requests ({largest} tokens)")  # fmt: skip
    mean = sum(o.here.prompt_len + (o.here.output_len or 0) for o in sample) / len(sample)
    at_once = min(running_cap(cfg), max(1, int(cfg.max_total_num_tokens / max(1.0, mean))))
    count = min(MAX_REPLAYED, max(math.ceil(len(sample) / shape.workers), SATURATE * at_once))
    res = simulate(cfg, _specs(sample, shape, count))
    if res.oom or res.stalled:
        why = f"it runs out of memory in {res.oom}" if res.oom else f"its replay stalled: {res.stalled}"
        return ShapeResult(shape=shape, output_tok_per_s=0.0, kv_tokens=cfg.max_total_num_tokens, unfit=why)
    return ShapeResult(
        shape=shape,
        output_tok_per_s=saturated_throughput(res) * shape.workers,
        kv_tokens=cfg.max_total_num_tokens,
        running=max((p.running for p in res.trace), default=0),
    )


def compare_shapes(
    twin: Twin,
    args: Mapping[str, object],
    sample: Sequence[Observed],
    current: Shape,
    tp_args: Mapping[int, Mapping[str, object]],
    *,
    fresh: Mapping[str, object] | None = None,
    min_gain: float = 0.0,
) -> ShapeComparison | None:
    """Each shape of the current shape's GPUs priced on ``sample`` (the pool's recent requests, in
    arrival order); ``tp_args``: the engine's placement flags per tp; ``fresh``: the arguments another
    shape's workers start from (default ``args``). The best is another shape only where it beats the
    current one by more than ``min_gain``. None: nothing to replay."""
    if not sample:
        return None
    ordered = sorted(sample, key=lambda o: o.arrived)
    results = []
    for shape in shapes_for(current.gpus):
        if shape.tp not in tp_args:
            continue
        base = args if shape == current or fresh is None else fresh
        shaped = shape_args(base, current.tp, shape.tp, tp_args[shape.tp])
        results.append(price_shape(twin, shaped, ordered, shape))
    now = next((r for r in results if r.shape == current), None)
    if now is None:
        return None
    best = max(results, key=lambda r: r.output_tok_per_s)
    if best.output_tok_per_s <= now.output_tok_per_s * (1.0 + min_gain):
        best = now
    return ShapeComparison(current=now, results=tuple(results), best=best, replayed_requests=len(ordered))
