"""A worker's activation memory, as a model of it gives it, against the memory its start-up leaves.

:class:`Activations` is what the start-up rules (``proxy.control.rules``) and the planner read: a
prefill chunk's and a decode batch's activations, the KV pool and the CUDA graphs. The arithmetic
here is pure: how much of the pool a decode batch that does not fit should take
(:func:`decode_split_mib`), and which graphs cover a running cap (:func:`covering_graphs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ACTIVATION_MARGIN", "GRAPH_POOL_SHARE", "MIN_FREE_GB", "Activations", "covering_graphs", "decode_split_mib"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Activations:
    """A worker's activation memory as a model of it gives it (the planner's twin): what a prefill
    forward needs per token, what a decode batch beyond the CUDA graphs needs per request, and the KV
    pool the same model computes for the worker's arguments (a pool unlike the one the worker reported
    says the model is not this worker's, and it is not used)."""

    prefill_mib_per_token: float
    decode_mib_per_seq: float
    graph_max_bs: int  # decode batches up to this many run in the graphs captured at start-up
    pool_tokens: int
    model: str  # whose presets, for the journal
    pool_mib: float = 0.0  # the KV pool's memory (0: not known)
    graph_mib_per_bs: float = 0.0  # the memory the CUDA graphs take per decode batch size they cover (0: not known)
    total_mib: float = 0.0  # the memory of the worker's GPUs, all of them as ``pool_mib`` (0: not known)
    devices: int = 1  # the GPUs the pool and the weights are spread over (tensor parallelism)

    def free_floor_gb(self, chunk: float) -> float:
        """The free memory a worker must have at start-up to run a full prefill chunk of ``chunk``
        tokens with :data:`ACTIVATION_MARGIN` to spare (GB as SGLang reports it: GiB)."""
        return max(MIN_FREE_GB, ACTIVATION_MARGIN * chunk * self.prefill_mib_per_token / 1024)

    def decode_gb(self, batch: float) -> float:
        """The activations of a decode batch of ``batch`` requests where it runs without the CUDA graphs
        (larger than they cover; 0 where they cover it), in GB as SGLang reports it."""
        return batch * self.decode_mib_per_seq / 1024 if batch > self.graph_max_bs else 0.0


# The free-memory floor where a model of the worker's activations is its own (``free_floor_gb``); the
# band's fixed floor is used only where none is. The activations are presets, not measured (an engine
# may need a quarter more), hence the margin; what no model counts (allocator slack, NCCL buffers)
# is SGLang's own fixed reserve, 512 MiB.
ACTIVATION_MARGIN = 1.5
MIN_FREE_GB = 0.5


def decode_split_mib(free_mib: float, need_mib: float, pool_mib: float) -> float:
    """The memory to move from the KV pool to the activations when a running cap's decode batch needs
    ``need_mib`` and ``free_mib`` is free. Neither side pays alone: the pool's loss (a share of it, what
    a batch the pool bounds loses) equals the cap's (the share of the cap that still does not fit, what
    a batch the cap bounds loses), so the worse of the two is as small as it can be. A pool a third full
    loses nothing; a cap cut to the fit loses what the workload would have run past it."""
    short = need_mib - free_mib
    if short <= 0 or pool_mib <= 0:
        return 0.0
    return short * pool_mib / (need_mib + pool_mib)


# The share of the KV pool the CUDA graphs may take when raised before a launch. A decode step past the
# graphs pays a kernel launch per layer (the simulator's presets: 32 x 150 us, 15-20 % of an 8B model's
# memory-bound step); graphs in 2 % of the pool cost at most 2 % of the batch where the pool binds, an
# order less than they give back where the batch outgrows them.
GRAPH_POOL_SHARE = 0.02


def covering_graphs(act: Activations, ladder: Sequence[float], running: float | None, upper: float) -> int:
    """The CUDA graphs' batch size that covers a running cap of ``running`` (None: no cap known) as far as
    their memory stays within :data:`GRAPH_POOL_SHARE` of the KV pool and ``upper`` (the policy's
    bound): the cap itself where it is within both, else the ladder's highest rung within them (0:
    none known)."""
    if act.graph_mib_per_bs <= 0:
        return 0
    bound = min(GRAPH_POOL_SHARE * act.pool_mib / act.graph_mib_per_bs, upper)
    if running is not None and running <= bound:
        return int(running)
    return int(max((r for r in ladder if r <= bound), default=0))
