"""vLLM's retunable arguments, behind the controller's engine-neutral knob names.

| knob | vLLM field | unset (0.32, OpenAI server) | range / ladder |
|---|---|---|---|
| max_running | ``max_num_seqs`` | 128 on the CPU, 256 on GPUs, 1024 on >= 70 GiB GPUs other than A100 | >= 1 |
| prefill_chunk | ``max_num_batched_tokens`` | 2048 (CPU and smaller GPUs), 8192 (>= 70 GiB), 16384 (>= 160 GiB) | 256 .. 16384 |
| memory_fraction | ``gpu_memory_utilization`` | 0.92 (0.9 before) | 0.05 .. 0.99 |
| max_context | ``max_model_len`` | the model's ``max_position_embeddings``; the start-up line prints it | >= 16 |
| graph_max_bs | ``max_cudagraph_capture_size`` (CompilationConfig) | ``min(2 x max_num_seqs, 512)`` | 1 .. 1024 |

vLLM has no admission-conservativeness argument: the lever against preemptions (V1 preempts by
recompute when the KV cache cannot grow a running request) is ``max_num_seqs``, so the table has no
``conservativeness`` entry and a rule that finds none falls back to ``max_running``. vLLM checks at
start-up that ``max_num_batched_tokens >= max_num_seqs``; :func:`consistent` keeps a proposal valid.

``max_context`` is moved after a start-up refusal (``KV_CAPACITY_ERROR``): vLLM prints the largest
length the cache holds (``estimated_max_model_len``), and :func:`fitting_max_model_len` rounds it
down to a block multiple.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.engines.base import Choice, Knob, KnobName

__all__ = ["KNOBS", "choice_args", "consistent", "fitting_max_model_len", "knobs"]

KNOBS: Mapping[KnobName, Knob] = {
    KnobName.MAX_RUNNING: Knob(
        name=KnobName.MAX_RUNNING,
        arg="max_num_seqs",
        default=None,  # depends on the device (see the table above); never printed at start-up
        minimum=1,
        maximum=4096,
        integer=True,
    ),
    KnobName.PREFILL_CHUNK: Knob(
        name=KnobName.PREFILL_CHUNK,
        arg="max_num_batched_tokens",
        default=None,
        minimum=256,
        maximum=16384,
        integer=True,
        ladder=(256, 512, 1024, 2048, 4096, 8192, 16384),
    ),
    KnobName.MEMORY_FRACTION: Knob(
        name=KnobName.MEMORY_FRACTION,
        arg="gpu_memory_utilization",
        default=0.92,
        minimum=0.05,
        maximum=0.99,
    ),
    KnobName.MAX_CONTEXT: Knob(
        name=KnobName.MAX_CONTEXT,
        arg="max_model_len",
        default=None,
        minimum=16,
        maximum=10_000_000,
        integer=True,
        resolved_field="max_model_len",  # STARTUP: "... Maximum concurrency for N tokens per request"
    ),
    # the largest batch vLLM captures as a CUDA graph: a decode batch past it runs without one. The
    # planner's twin does not model vLLM: a batch seen past it is journalled as a suggestion, not priced
    KnobName.GRAPH_MAX_BS: Knob(
        name=KnobName.GRAPH_MAX_BS,
        arg="max_cudagraph_capture_size",
        default=512,  # unset: min(2 x max_num_seqs, 512); the largest it takes
        minimum=1,
        maximum=1024,
        integer=True,
        ladder=(256, 512, 768, 1024),
    ),
}


def choice_args(choice: Choice, args: Mapping[str, object]) -> dict[str, object] | None:
    """vLLM's flags for a person's choice (``--quantization fp8``, ``--kv-cache-dtype fp8``); None where
    ``args`` have it on already, and for torch.compile, which vLLM V1 runs by default (unless
    ``--enforce-eager``, which a person chose)."""
    if choice is Choice.FP8_WEIGHTS:
        return None if args.get("quantization") else {"quantization": "fp8"}
    if choice is Choice.FP8_KV_CACHE:
        return None if args.get("kv_cache_dtype") not in (None, "auto") else {"kv_cache_dtype": "fp8"}
    if choice is Choice.CHUNKED_PREFILL:
        return {"enable_chunked_prefill": True} if args.get("enable_chunked_prefill") is False else None
    return None


def knobs() -> Mapping[KnobName, Knob]:
    """The table above (what ``EngineSpec.function("knobs", "knobs")`` returns)."""
    return KNOBS


def fitting_max_model_len(estimated: int, block_size: int = 16) -> int:
    """The largest ``max_model_len`` at most ``estimated`` that is a whole number of KV blocks."""
    knob = KNOBS[KnobName.MAX_CONTEXT]
    fitted = (int(estimated) // block_size) * block_size
    return int(knob.clamp(fitted if fitted >= knob.minimum else estimated))


def consistent(args: Mapping[str, object]) -> dict[str, object]:
    """``args`` with ``max_num_batched_tokens`` raised to ``max_num_seqs`` where vLLM would refuse it."""
    out = dict(args)
    seqs, batched = out.get("max_num_seqs"), out.get("max_num_batched_tokens")
    if isinstance(seqs, int) and isinstance(batched, int) and batched < seqs:
        out["max_num_batched_tokens"] = seqs
    return out
