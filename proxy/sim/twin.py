"""The planner's twin of a worker: the simulator's config under the worker's arguments.

The twin is the simulated engine (an SGLang model) on a GPU and model preset, its step time and KV
pool corrected by what the worker reported. The planner reaches it through the engine contract
(:attr:`TWIN_ENGINE`: the argument names the twin's knobs move, the arguments it reads) and these
functions, never through the simulator's command line or its config's field names.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.engines.contract import Engine
from proxy.engines.sglang.engine import SIM
from proxy.sim.cli import build_parser
from proxy.sim.config import SimConfig, resolve_config

__all__ = [
    "CAPACITY_ARGS",
    "TP_ARG",
    "TWIN_ENGINE",
    "graph_max_bs",
    "memory_fraction",
    "prefill_chunk",
    "queue_order",
    "running_cap",
    "twin_config",
]

TWIN_ENGINE: Engine = SIM  # the engine the twin models
# the arguments that cap a worker's capacity (running requests, KV tokens): a reshape keeps them per GPU
CAPACITY_ARGS = ("max_running_requests", "max_total_tokens")
TP_ARG = "tp_size"  # a worker's tensor parallel size, as the twin's engine names it


def twin_config(
    gpu: str, model: str, args: Mapping[str, object], *, step_time_factor: float = 1.0, kv_factor: float = 1.0
) -> SimConfig:
    """The simulator's resolved config on ``gpu`` and ``model`` under ``args`` (as the engine contract's
    ``twin_args`` gives them; those the simulator does not take are left out), its step time scaled by
    ``step_time_factor`` and its KV pool by ``kv_factor`` (below 1 only). Raises SimConfigError: it
    would not start."""
    ns = build_parser().parse_args(["--sim-gpu", gpu, "--sim-model", model])
    for key, value in args.items():
        if hasattr(ns, key):
            setattr(ns, key, value)
    ns.sim_step_time_factor = step_time_factor
    cfg = resolve_config(ns)
    if kv_factor < 1.0:
        ns.max_total_tokens = max(1, int(cfg.max_total_num_tokens * kv_factor))
        cfg = resolve_config(ns)
    return cfg


def prefill_chunk(cfg: SimConfig) -> int | None:
    """The tokens of one prefill chunk under ``cfg`` (None: chunking off)."""
    return cfg.chunked_prefill_size


def memory_fraction(cfg: SimConfig) -> float:
    """The share of device memory for weights and the KV pool under ``cfg``."""
    return cfg.mem_fraction_static


def running_cap(cfg: SimConfig) -> int:
    """The most requests the worker runs at once under ``cfg``."""
    return cfg.max_running_requests


def graph_max_bs(cfg: SimConfig) -> int:
    """The largest decode batch run as a CUDA graph under ``cfg`` (0: graphs off)."""
    return cfg.cuda_graph_max_bs_decode


def queue_order(cfg: SimConfig) -> str:
    """The waiting queue's order under ``cfg`` (SGLang's ``--schedule-policy``)."""
    return cfg.schedule_policy
