"""The hold at the CUDA graphs: the proxy keeps a worker at the batch its graphs cover, no restart.

An engine may admit past that batch (an output budget frees what SGLang's reservation for
``max_tokens`` held back); each decode step past it runs without graphs, slower for every request
it holds. Whether holding the worker there pays depends on the answers: longer ones gain more from
the larger batch than the graphs save. So the planner's twin prices it on each look, beside the
restart candidates (:func:`price_hold`). The fast tier holds the worker at that many open requests
where a look says it pays, and lets it go where a look says it loses
(:func:`~proxy.control.fast_tier.held_open`); a look inside the twin's noise says neither and leaves
it as it is, as a gain inside the twin's error never restarts a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.control.twin import Prediction, Twin
from proxy.control.workload import Replay
from proxy.sim.config import SimConfigError
from proxy.sim.twin import graph_max_bs, running_cap

__all__ = ["HoldPrice", "hold_loses", "hold_pays", "price_hold"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldPrice:
    """The twin's worker held at ``at`` open requests (its graphs' batch): whether that pays, loses, or
    (neither) lies inside the twin's noise."""

    at: int
    held: Prediction
    pays: bool
    loses: bool
    against: Prediction | None = None  # the replay not held it was weighed against


def hold_pays(held: Prediction, current: Prediction, min_gain: float, *, backlog: bool = False) -> bool:
    """Whether the held replay writes more than the current one by ``min_gain``, or the same tokens (no
    fewer less ``min_gain``, as the planner's waiting basis counts them) answered sooner by
    ``min_gain``: a worker that keeps up with what arrives writes what arrives either way. Not the
    latter in a ``backlog`` (the planner's: work waits throughout, throughput is what counts)."""
    if held.oom or current.output_tok_per_s <= 0:
        return False
    if held.output_tok_per_s >= current.output_tok_per_s * (1.0 + min_gain):
        return True
    same = held.output_tok_per_s >= current.output_tok_per_s * (1.0 - min_gain)
    answers, now = held.mean_answer_s, current.mean_answer_s
    sooner = answers is not None and now is not None and answers <= now * (1.0 - min_gain)
    return same and sooner and not backlog


def hold_loses(held: Prediction, current: Prediction, min_gain: float, *, backlog: bool = False) -> bool:
    """Whether the held replay writes fewer tokens than the current one by ``min_gain``, or (not in a
    ``backlog``) the same tokens answered later by ``min_gain``: :func:`hold_pays` the other way round."""
    if held.oom:
        return True
    if held.output_tok_per_s < current.output_tok_per_s * (1.0 - min_gain):
        return True
    answers, now = held.mean_answer_s, current.mean_answer_s
    later = answers is not None and now is not None and answers >= now * (1.0 + min_gain)
    return later and not backlog


def price_hold(
    twin: Twin,
    args: Mapping[str, object],
    loaded: Replay,
    current: Prediction,
    min_gain: float,
    *,
    backlog: bool = False,
) -> HoldPrice | None:
    """The hold's price on the look's replay (``loaded``; ``current``: the twin under ``args`` on it;
    ``backlog``: the planner's, throughput alone counts); None where the replay never ran past the
    graphs, or the worker has none. The held replay runs the engine capped at the graphs' batch (the
    proxy holds the rest; its gate is the twin's)."""
    try:
        cfg = twin.config(args)
    except SimConfigError:
        return None
    graphs, names = graph_max_bs(cfg), twin.names
    if graphs <= 0 or running_cap(cfg) <= graphs or current.peak_running <= graphs or current.oom:
        return None
    held_args = {**args, names.max_running: graphs}
    if names.graph_max_bs is not None:  # as it resolved: a running cap may lower the engine's default
        held_args[names.graph_max_bs] = graphs
    held = twin.predict(held_args, loaded)
    return HoldPrice(at=graphs, held=held, against=current, pays=hold_pays(held, current, min_gain, backlog=backlog),
                     loses=hold_loses(held, current, min_gain, backlog=backlog))  # fmt: skip
