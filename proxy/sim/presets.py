"""GPU and model presets of the simulated engine (``--sim-gpu``, ``--sim-model``).

A GPU preset is what ``torch.cuda.mem_get_info`` would report (total memory in MiB) plus the two
figures the step-time model needs (HBM bandwidth, dense bf16 tensor throughput). A model preset is
what the weights and ``config.json`` fix: the weights' size, the KV-cache bytes per token
(``2 x layers x kv_heads x head_dim x dtype bytes``), the context length and the sizes the
activation and step-time models use.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPreset:
    name: str
    label: str  # as nvidia-smi names it
    memory_mib: int  # total device memory as the driver reports it
    bandwidth_gbs: float  # HBM/GDDR bandwidth, 1e9 bytes/s
    bf16_tflops: float  # dense bf16 tensor throughput, 1e12 flop/s


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPreset:
    name: str
    hf_name: str  # the default --model-path
    architecture: str
    params: float  # parameter count
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int  # max_position_embeddings
    eos_token_id: int
    # Activation memory (see memory.py): a prefill token's transient buffers, and a decode sequence's
    # (logits in fp32 dominate) when it runs outside a captured CUDA graph.
    prefill_act_mib_per_token: float
    decode_act_mib_per_seq: float

    @property
    def weights_bytes_bf16(self) -> float:
        return self.params * 2.0

    @property
    def kv_bytes_per_token_bf16(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset(
            name="h100-80gb", label="NVIDIA H100 80GB HBM3", memory_mib=81559, bandwidth_gbs=3350.0, bf16_tflops=989.0
        ),
        GpuPreset(name="h200-141gb", label="NVIDIA H200", memory_mib=143771, bandwidth_gbs=4800.0, bf16_tflops=989.0),
        GpuPreset(
            name="a100-80gb", label="NVIDIA A100-SXM4-80GB", memory_mib=81920, bandwidth_gbs=2039.0, bf16_tflops=312.0
        ),
        GpuPreset(
            name="a100-40gb", label="NVIDIA A100-SXM4-40GB", memory_mib=40536, bandwidth_gbs=1555.0, bf16_tflops=312.0
        ),
        GpuPreset(name="l40s-48gb", label="NVIDIA L40S", memory_mib=46068, bandwidth_gbs=864.0, bf16_tflops=362.0),
        GpuPreset(
            name="rtx4090-24gb",
            label="NVIDIA GeForce RTX 4090",
            memory_mib=24564,
            bandwidth_gbs=1008.0,
            bf16_tflops=165.0,
        ),
        GpuPreset(
            name="rtx3080-10gb",
            label="NVIDIA GeForce RTX 3080",
            memory_mib=10240,
            bandwidth_gbs=760.0,
            bf16_tflops=119.0,
        ),
    )
}

# NVLink bandwidth per GPU and direction, 1e9 bytes/s, by preset (tensor parallel's collectives); a GPU
# not named here links its peers over PCIe (proxy.sim.steptime)
NVLINK_GBS: dict[str, float] = {"h100-80gb": 450.0, "h200-141gb": 450.0, "a100-80gb": 300.0, "a100-40gb": 300.0}

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset(
            name="llama-3.1-8b", hf_name="meta-llama/Llama-3.1-8B-Instruct", architecture="LlamaForCausalLM",
            params=8.03e9, num_layers=32, hidden_size=4096, num_kv_heads=8, head_dim=128, vocab_size=128256,
            context_length=131072, eos_token_id=128009, prefill_act_mib_per_token=0.25, decode_act_mib_per_seq=1.25,
        ),
        ModelPreset(
            name="llama-3.2-1b", hf_name="meta-llama/Llama-3.2-1B-Instruct", architecture="LlamaForCausalLM",
            params=1.24e9, num_layers=16, hidden_size=2048, num_kv_heads=8, head_dim=64, vocab_size=128256,
            context_length=131072, eos_token_id=128009, prefill_act_mib_per_token=0.08, decode_act_mib_per_seq=1.1,
        ),
        ModelPreset(
            name="qwen2.5-7b", hf_name="Qwen/Qwen2.5-7B-Instruct", architecture="Qwen2ForCausalLM",
            params=7.62e9, num_layers=28, hidden_size=3584, num_kv_heads=4, head_dim=128, vocab_size=152064,
            context_length=32768, eos_token_id=151645, prefill_act_mib_per_token=0.22, decode_act_mib_per_seq=1.3,
        ),
        ModelPreset(  # 70B-class: served at tp 4 or 8 (140 GB of bf16 weights)
            name="llama-3.1-70b", hf_name="meta-llama/Llama-3.1-70B-Instruct", architecture="LlamaForCausalLM",
            params=70.6e9, num_layers=80, hidden_size=8192, num_kv_heads=8, head_dim=128, vocab_size=128256,
            context_length=131072, eos_token_id=128009, prefill_act_mib_per_token=0.6, decode_act_mib_per_seq=1.6,
        ),
    )
}  # fmt: skip

# Bytes per weight / per KV element by --quantization / --kv-cache-dtype (None and "auto" = bf16).
WEIGHT_BYTES_FACTOR: dict[str | None, float] = {
    None: 1.0,
    "unquant": 1.0,
    "fp8": 0.5,
    "w8a8_fp8": 0.5,
    "w8a8_int8": 0.5,
    "modelopt_fp8": 0.5,
    "awq": 0.28,
    "gptq": 0.28,
    "mxfp4": 0.27,
}
KV_BYTES_FACTOR: dict[str, float] = {"auto": 1.0, "bf16": 1.0, "bfloat16": 1.0, "fp8_e4m3": 0.5, "fp8_e5m2": 0.5}
