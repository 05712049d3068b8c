"""The simulated server's resolved arguments: SGLang's flags with SGLang's defaults filled in.

:func:`resolve_config` turns the parsed command line (``proxy.sim.cli.build_parser``) into a frozen
:class:`SimConfig`; the HTTP server and :func:`proxy.sim.virtual.simulate` both start from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.sim import memory
from proxy.sim.presets import GPUS, KV_BYTES_FACTOR, MODELS, WEIGHT_BYTES_FACTOR, GpuPreset, ModelPreset
from proxy.sim.steptime import StepTimeModel, startup_seconds

PRIORITY_POLICIES = ("fcfs", "lof")  # the policies SGLang orders by priority (and the only ones it allows with it)


class SimConfigError(ValueError):
    """The arguments cannot describe a server that starts (SGLang would exit at start-up)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    # identity and serving
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # hardware and model
    gpu: GpuPreset
    model: ModelPreset
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    weights_bytes: float
    kv_bytes_per_token: float
    memory: memory.MemoryPlan
    # scheduling (resolved)
    mem_fraction_static: float
    max_total_num_tokens: int
    chunked_prefill_size: int | None  # None: chunked prefill disabled (-1)
    max_prefill_tokens: int = 16384
    max_running_requests: int
    max_queued_requests: int | None = None
    context_len: int
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    cuda_graph_max_bs_decode: int  # 0: CUDA graphs disabled
    enable_metrics: bool = False
    enable_cache_report: bool = False
    decode_log_interval: int = 40
    tp_size: int = 1
    # simulator
    time_scale: float = 1.0
    seed: int = 0
    startup_wall_seconds: float  # real seconds from launch to ready
    output_fraction: float = 1.0
    output_spread: float = 0.0
    output_cap: int | None = None
    step_time_factor: float = 1.0  # steps take this many times the modelled time (perturbation)
    activation_factor: float = 1.0  # activations take this many times the modelled memory (perturbation)
    server_args: Mapping[str, Any] = field(default_factory=dict)  # every flag, for /server_info

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_len - 1, self.max_total_num_tokens - 1)

    def step_model(self) -> StepTimeModel:
        return StepTimeModel(
            params=self.model.params,
            num_layers=self.model.num_layers,
            hidden_size=self.model.hidden_size,
            weights_bytes=self.weights_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            bandwidth_gbs=self.gpu.bandwidth_gbs,
            bf16_tflops=self.gpu.bf16_tflops,
        )


def _check_args(ns: argparse.Namespace) -> None:
    """Refuse what the simulator does not model, or what SGLang itself refuses to start with."""
    if ns.sim_gpu not in GPUS:
        raise SimConfigError(f"unknown --sim-gpu {ns.sim_gpu!r}; choose from {', '.join(GPUS)}")
    if ns.sim_model not in MODELS:
        raise SimConfigError(f"unknown --sim-model {ns.sim_model!r}; choose from {', '.join(MODELS)}")
    tp = ns.tp_size or 1
    if tp not in (1, 2, 4, 8):
        raise SimConfigError(f"the simulator models --tp-size 1, 2, 4 or 8; got {tp}")
    if (ns.dp_size or 1) != 1 or (ns.pp_size or 1) != 1:
        raise SimConfigError("the simulator models one worker process: --dp-size and --pp-size must be 1")
    if ns.page_size not in (None, 1):
        raise SimConfigError("the simulator models --page-size 1 only")
    if ns.sim_time_scale <= 0:
        raise SimConfigError("--sim-time-scale must be > 0")
    if ns.sim_step_time_factor <= 0 or ns.sim_activation_factor <= 0:
        raise SimConfigError("--sim-step-time-factor and --sim-activation-factor must be > 0")
    if ns.schedule_conservativeness < 0:
        raise SimConfigError("--schedule-conservativeness must be >= 0")
    if ns.enable_priority_scheduling and ns.schedule_policy not in PRIORITY_POLICIES:
        raise SimConfigError(  # SGLang's server_args refuses to start the same way
            f"--enable-priority-scheduling needs --schedule-policy fcfs or lof, not {ns.schedule_policy!r}"
        )


def _tensor_parallel_node(gpu: GpuPreset, tp: int) -> GpuPreset:
    """One GPU, or tp of them seen as one: the weights and the KV pool spread over tp GPUs, and each
    step reads them at tp times the bandwidth (per-GPU defaults still come from one GPU)."""
    if tp == 1:
        return gpu
    return replace(
        gpu,
        memory_mib=gpu.memory_mib * tp,
        bandwidth_gbs=gpu.bandwidth_gbs * tp,
        bf16_tflops=gpu.bf16_tflops * tp,
    )


def _chunked_prefill_size(ns: argparse.Namespace, gpu: GpuPreset) -> int | None:
    """The prefill chunk in tokens: the GPU's default when unset, None (no chunking) when <= 0."""
    if ns.chunked_prefill_size is None:
        return memory.default_chunked_prefill_size(gpu.memory_mib)
    if ns.chunked_prefill_size <= 0:
        return None
    return int(ns.chunked_prefill_size)


def _cuda_graph_max_bs(ns: argparse.Namespace, gpu: GpuPreset) -> int:
    """The largest decode batch captured in a CUDA graph; 0 when graphs are off."""
    if ns.disable_cuda_graph or ns.cuda_graph_backend_decode == "disabled":
        return 0
    if ns.cuda_graph_max_bs_decode is not None:
        return int(ns.cuda_graph_max_bs_decode)
    return memory.default_cuda_graph_max_bs(gpu.memory_mib, ns.tp_size or 1, ns.max_running_requests)


def _mem_fraction_static(ns: argparse.Namespace, gpu: GpuPreset, chunked: int | None, graph_bs: int) -> float:
    """``--mem-fraction-static``, or SGLang's default for this GPU, chunk and graph sizes."""
    mfs = ns.mem_fraction_static
    if mfs is None:
        mfs = memory.default_mem_fraction_static(gpu.memory_mib, chunked, graph_bs)
    if not 0 < mfs <= 1:
        raise SimConfigError("--mem-fraction-static must be in (0, 1]")
    return float(mfs)


def _kv_pool_plan(
    ns: argparse.Namespace, node: GpuPreset, *, weights: float, kv_bytes: float, mfs: float, graph_bs: int
) -> memory.MemoryPlan:
    """The memory plan; refused, as SGLang refuses, when no KV pool is left."""
    plan = memory.plan_memory(
        node,
        weights_bytes=weights,
        kv_bytes_per_token=kv_bytes,
        mem_fraction_static=mfs,
        max_total_tokens=ns.max_total_tokens,
        graph_max_bs=graph_bs,
    )
    if plan.max_total_num_tokens <= 0:
        raise SimConfigError("Not enough memory. Please try to increase --mem-fraction-static.")
    return plan


def _startup_wall_seconds(ns: argparse.Namespace, weights: float, graph_bs: int) -> float:
    """Wall seconds from launch to ready: the override, else the modelled start-up at the time scale."""
    if ns.sim_startup_seconds is not None:
        return max(0.0, float(ns.sim_startup_seconds))
    _, _, modelled_startup = startup_seconds(weights, graph_bs)
    return max(0.0, float(modelled_startup / ns.sim_time_scale))


def _reported_args(ns: argparse.Namespace, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The server args as the server reports them: the resolved values over the given ones, less the
    hidden perturbations (nothing reading /server_info or the log sees them)."""
    args = {k: v for k, v in vars(ns).items() if k not in ("sim_step_time_factor", "sim_activation_factor")}
    args.update(resolved)
    return args


def resolve_config(ns: argparse.Namespace) -> SimConfig:
    """SGLang's resolution order: GPU-memory defaults, then the KV pool, then request limits."""
    _check_args(ns)
    tp = ns.tp_size or 1
    gpu, model = GPUS[ns.sim_gpu], MODELS[ns.sim_model]
    node = _tensor_parallel_node(gpu, tp)
    weights = model.weights_bytes_bf16 * WEIGHT_BYTES_FACTOR.get(ns.quantization, 1.0)
    kv_bytes = model.kv_bytes_per_token_bf16 * KV_BYTES_FACTOR.get(ns.kv_cache_dtype or "auto", 1.0)
    chunked = _chunked_prefill_size(ns, gpu)
    graph_bs = _cuda_graph_max_bs(ns, gpu)
    mfs = _mem_fraction_static(ns, gpu, chunked, graph_bs)
    plan = _kv_pool_plan(ns, node, weights=weights, kv_bytes=kv_bytes, mfs=mfs, graph_bs=graph_bs)
    tokens = plan.max_total_num_tokens
    context_len = ns.context_length or model.context_length
    max_running = memory.default_max_running_requests(tokens, context_len, ns.max_running_requests)
    if graph_bs:
        graph_bs = min(graph_bs, max_running)
    model_path = ns.model_path or model.hf_name
    served = ns.served_model_name or model_path
    args = _reported_args(
        ns,
        dict(
            model_path=model_path,
            served_model_name=served,
            mem_fraction_static=mfs,
            chunked_prefill_size=chunked if chunked is not None else -1,
            max_running_requests=max_running,
            max_total_tokens=ns.max_total_tokens,
            context_length=context_len,
            cuda_graph_max_bs_decode=graph_bs,
            page_size=1,
            tp_size=tp,
            dp_size=1,
        ),
    )
    return SimConfig(
        model_path=model_path,
        served_model_name=served,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        gpu=node,
        model=model,
        quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype or "auto",
        weights_bytes=weights,
        kv_bytes_per_token=kv_bytes,
        memory=plan,
        mem_fraction_static=mfs,
        max_total_num_tokens=tokens,
        chunked_prefill_size=chunked,
        max_prefill_tokens=ns.max_prefill_tokens,
        max_running_requests=max_running,
        max_queued_requests=ns.max_queued_requests,
        context_len=context_len,
        schedule_policy=ns.schedule_policy,
        enable_priority_scheduling=ns.enable_priority_scheduling,
        schedule_low_priority_values_first=ns.schedule_low_priority_values_first,
        priority_scheduling_preemption_threshold=ns.priority_scheduling_preemption_threshold,
        disable_priority_preemption=ns.disable_priority_preemption,
        schedule_conservativeness=ns.schedule_conservativeness,
        disable_radix_cache=ns.disable_radix_cache,
        cuda_graph_max_bs_decode=graph_bs,
        tp_size=tp,
        enable_metrics=ns.enable_metrics,
        enable_cache_report=ns.enable_cache_report,
        decode_log_interval=max(1, ns.decode_log_interval),
        time_scale=ns.sim_time_scale,
        seed=ns.sim_seed if ns.sim_seed is not None else (ns.random_seed or 0),
        startup_wall_seconds=_startup_wall_seconds(ns, weights, graph_bs),
        output_fraction=ns.sim_output_fraction,
        output_spread=ns.sim_output_spread,
        output_cap=ns.sim_output_cap,
        step_time_factor=ns.sim_step_time_factor,
        activation_factor=ns.sim_activation_factor,
        server_args=args,
    )
