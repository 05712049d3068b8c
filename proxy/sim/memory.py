"""GPU memory: SGLang's memory defaults, the KV pool size, and what activations need.

Layout of one GPU (MiB), as SGLang lays it out::

    total = weights + KV pool + CUDA graph buffers + CUDA context + free
            \\____ mem_fraction_static x total ___/                   \\__ available_gpu_mem

* ``mem_fraction_static`` (unset): ``(total - reserved) / total`` rounded to 3 places, with
  ``reserved = 512 + max(chunked_prefill_size, 2048) x 1.5 + tp x pp / 8 x 1024 + 2 x graph max bs``
  and at least 10 GiB on GPUs over 60 GiB (SGLang ``memory_hook.handle_gpu_memory_settings``).
* KV pool tokens: ``(mem_fraction_static x total - weights) / kv bytes per token``, capped by
  ``--max-total-tokens``.
* ``available_gpu_mem`` (the start-up line) is what is left for activations once weights, the pool,
  the CUDA graphs and the CUDA context are placed. A prefill chunk needs
  ``tokens x prefill_act_mib_per_token``; a decode batch outside the captured CUDA graphs needs
  ``bs x decode_act_mib_per_seq`` (a batch the graphs cover runs in their preallocated pool). Needing
  more than ``available_gpu_mem`` is a CUDA out-of-memory error.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.sim.presets import MIB, GpuPreset, ModelPreset

CUDA_CONTEXT_MIB = 512.0  # driver context + allocator slack, never available to activations
GRAPH_MIB_PER_BS = 2.0  # CUDA graph buffers per captured decode batch size (SGLang reserves 2 MiB x max bs)

# (upper bound of GPU memory in GiB, chunked_prefill_size, decode graph max bs for tp < 4, for tp >= 4)
_GPU_TIERS: tuple[tuple[float, int, int, int], ...] = (
    (20, 2048, 8, 8),
    (35, 4096, 48, 160),
    (60, 4096, 32, 160),
    (90, 8192, 256, 512),
    (160, 8192, 256, 512),
    (float("inf"), 16384, 512, 512),
)


def _tier(gpu_mem_mib: float) -> tuple[float, int, int, int]:
    return next(t for t in _GPU_TIERS if gpu_mem_mib < t[0] * 1024)


def default_chunked_prefill_size(gpu_mem_mib: float) -> int:
    return _tier(gpu_mem_mib)[1]


def default_cuda_graph_max_bs(gpu_mem_mib: float, tp_size: int = 1, max_running_requests: int | None = None) -> int:
    tier = _tier(gpu_mem_mib)
    max_bs = tier[2] if tp_size < 4 else tier[3]
    return min(max_bs, max_running_requests) if max_running_requests else max_bs


def default_mem_fraction_static(
    gpu_mem_mib: float, chunked_prefill_size: int | None, graph_max_bs: int, tp_size: int = 1, pp_size: int = 1
) -> float:
    activation_tokens = max(chunked_prefill_size or 0, 2048)
    reserved = 512 + activation_tokens * 1.5 + tp_size * pp_size / 8 * 1024 + GRAPH_MIB_PER_BS * graph_max_bs
    if gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


def kv_pool_tokens(
    gpu_mem_mib: float, mem_fraction_static: float, weights_bytes: float, kv_bytes_per_token: float
) -> int:
    """Tokens the profiled pool holds (may be <= 0: the weights leave no room)."""
    rest = mem_fraction_static * gpu_mem_mib * MIB - weights_bytes
    return int(rest // kv_bytes_per_token)


def default_max_running_requests(token_capacity: int, context_len: int, given: int | None = None) -> int:
    if given is not None:
        return min(max(1, given), token_capacity // 2)
    estimated = max(min(int(token_capacity / context_len * 512), 4096), 2048)
    return min(estimated, token_capacity // 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """Where the GPU's memory went at start-up (MiB), and what is left for activations."""

    total_mib: float
    weights_mib: float
    kv_pool_mib: float
    graph_mib: float
    context_mib: float
    max_total_num_tokens: int

    @property
    def available_mib(self) -> float:
        return self.total_mib - self.weights_mib - self.kv_pool_mib - self.graph_mib - self.context_mib

    @property
    def available_gb(self) -> float:  # SGLang prints GiB and calls them GB
        return self.available_mib / 1024


def plan_memory(
    gpu: GpuPreset,
    *,
    weights_bytes: float,
    kv_bytes_per_token: float,
    mem_fraction_static: float,
    max_total_tokens: int | None,
    graph_max_bs: int,
) -> MemoryPlan:
    tokens = kv_pool_tokens(gpu.memory_mib, mem_fraction_static, weights_bytes, kv_bytes_per_token)
    if max_total_tokens is not None and tokens > 0:
        tokens = min(tokens, max_total_tokens)
    return MemoryPlan(
        total_mib=float(gpu.memory_mib),
        weights_mib=weights_bytes / MIB,
        kv_pool_mib=max(tokens, 0) * kv_bytes_per_token / MIB,
        graph_mib=GRAPH_MIB_PER_BS * graph_max_bs,
        context_mib=CUDA_CONTEXT_MIB,
        max_total_num_tokens=tokens,
    )


def prefill_activation_mib(model: ModelPreset, tokens: int) -> float:
    return tokens * model.prefill_act_mib_per_token


def decode_activation_mib(model: ModelPreset, batch_size: int, graph_max_bs: int) -> float:
    """Zero while the CUDA graphs cover the batch (their buffers were reserved at capture)."""
    return 0.0 if batch_size <= graph_max_bs else batch_size * model.decode_act_mib_per_seq
