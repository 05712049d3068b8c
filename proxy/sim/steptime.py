"""How long one forward step takes on the modelled GPU. Every constant lives here.

Decode is memory-bound: each step streams the weights and every running sequence's KV cache::

    decode = STEP_OVERHEAD + (weights + kv_tokens x kv_bytes) / (bandwidth x MEM_BW_EFFICIENCY)
             + bs x DECODE_PER_SEQ [+ layers x EAGER_PER_LAYER when the batch is larger than the
             captured CUDA graphs]

Prefill is compute-bound (but never faster than one pass over the weights)::

    prefill = STEP_OVERHEAD + max(weights / (bandwidth x MEM_BW_EFFICIENCY),
                                  (2 x params x tokens + 4 x layers x hidden x attn_pairs)
                                  / (bf16 flops x FLOPS_EFFICIENCY))
              + seqs x PREFILL_PER_SEQ + layers x EAGER_PER_LAYER

where ``attn_pairs`` sums ``extend x (prefix + extend / 2)`` over the batch's requests.

At ``tp > 1`` the weights and KV cache split over ``tp`` GPUs and each step adds its collectives
(:meth:`StepTimeModel.tp_comm_seconds`); per-step and per-sequence overheads do not shrink. An ``lpm`` scheduling round (a radix match per waiting request, SGLang's ``calc_priority``) adds its
CPU time to the step it schedules: ``waiting x LPM_PER_REQ_S + tokens walked x LPM_PER_TOKEN_S``.

Calibration: the H100 + Llama-3.1-8B preset reproduces the guide's decode line (``#running-req:
233, #token: 370959``) and its logged gen throughput (tests/sim/test_steptime.py holds it there).
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_OVERHEAD_S = 0.004  # scheduling, sampling launch, detokenizer hand-off per forward
DECODE_PER_SEQ_S = 20e-6  # per running sequence per decode step (sampling, bookkeeping)
PREFILL_PER_SEQ_S = 50e-6  # per new sequence in a prefill batch
EAGER_PER_LAYER_S = 150e-6  # kernel-launch cost per layer when no CUDA graph replays the step
MEM_BW_EFFICIENCY = 0.5  # achieved / peak memory bandwidth
FLOPS_EFFICIENCY = 0.55  # achieved / peak dense bf16 throughput in prefill

# Start-up (modelled seconds): process start and imports, weights from disk, CUDA-graph capture.
STARTUP_BASE_S = 10.0
WEIGHTS_LOAD_GBS = 2.0  # 1e9 bytes/s from local NVMe, page cache cold
GRAPH_CAPTURE_PER_BS_S = 0.1  # per captured batch size
WARMUP_S = 1.0

# Tensor parallelism (assumed, not measured: SGLang's custom all-reduce on NVLink answers a small
# message in about 10 us; NCCL over PCIe in tens of us; a ring reaches ~70 % of the link).
TP_ALLREDUCES_PER_LAYER = 2  # o_proj and down_proj: RowParallelLinear(reduce_results=True)
TP_ALLREDUCES_PER_STEP = 1  # the input embedding: VocabParallelEmbedding reduces its shards' rows
ALLREDUCE_LATENCY_NVLINK_S = 10e-6
ALLREDUCE_LATENCY_PCIE_S = 30e-6
LINK_EFFICIENCY = 0.7  # achieved / peak link bandwidth of a ring collective
PCIE_GBS = 25.0  # a GPU's link where its preset names no NVLink (PCIe 4 x16, achieved)
ACT_BYTES = 2  # bf16 activations and logits
# lpm's scheduling CPU per round (SGLang schedule_policy.py and mem_cache/radix_cache.py): per waiting
# request a RadixKey, a match result and its index tensor (torch.cat), and in the queue's tree a torch
# tensor per insert; per token walked one iteration of CPython's zip-compare loop
LPM_PER_REQ_S = 15e-6
LPM_PER_TOKEN_S = 40e-9


def lpm_round_seconds(waiting: int, tokens_walked: int) -> float:
    """CPU seconds of one lpm scheduling round over ``waiting`` requests walking ``tokens_walked`` tokens."""
    return waiting * LPM_PER_REQ_S + tokens_walked * LPM_PER_TOKEN_S


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeModel:
    params: float
    num_layers: int
    hidden_size: int
    weights_bytes: float
    kv_bytes_per_token: float
    bandwidth_gbs: float
    bf16_tflops: float
    tp_size: int = 1
    link_gbs: float = 0.0  # one GPU's NVLink bandwidth, 1e9 bytes/s per direction (0: PCIe only)
    vocab_size: int = 0

    def tp_comm_seconds(self, tokens: int, sampled: int) -> float:
        """One step's collectives at ``tp_size`` (0 at tp 1). SGLang's Llama layers end their attention
        (``o_proj``) and their MLP (``down_proj``) in a row-parallel linear layer that all-reduces its
        output: two all-reduces per layer of ``tokens x hidden`` bf16 values (and one for the input
        embedding, split over the vocabulary like the output's); the logits of the
        ``sampled`` tokens are gathered over the vocabulary's ``tp`` shards. Each collective costs a
        latency plus a ring's ``2 (tp - 1) / tp`` of its bytes over the GPU's link (NVLink, else PCIe).
        The scheduler's per-step and per-sequence costs do not shrink with ``tp``: they are why
        replicas of a smaller tp serve more than one worker of a larger tp once memory allows."""
        tp = self.tp_size
        if tp <= 1:
            return 0.0
        nvlink = self.link_gbs > 0
        link = (self.link_gbs if nvlink else PCIE_GBS) * 1e9 * LINK_EFFICIENCY
        latency = ALLREDUCE_LATENCY_NVLINK_S if nvlink else ALLREDUCE_LATENCY_PCIE_S
        ring = 2.0 * (tp - 1) / tp
        reduce = latency + ring * tokens * self.hidden_size * ACT_BYTES / link
        gather = latency + (tp - 1) / tp * sampled * self.vocab_size * ACT_BYTES / link
        return (TP_ALLREDUCES_PER_LAYER * self.num_layers + TP_ALLREDUCES_PER_STEP) * reduce + gather

    def decode_seconds(self, batch_size: int, kv_tokens: int, cuda_graph: bool) -> float:
        bw = self.bandwidth_gbs * 1e9 * MEM_BW_EFFICIENCY
        t = STEP_OVERHEAD_S + (self.weights_bytes + kv_tokens * self.kv_bytes_per_token) / bw
        t += batch_size * DECODE_PER_SEQ_S
        if not cuda_graph:
            t += self.num_layers * EAGER_PER_LAYER_S
        return t + self.tp_comm_seconds(batch_size, batch_size)

    def prefill_seconds(self, extend_tokens: int, attn_pairs: float, num_seqs: int) -> float:
        bw = self.bandwidth_gbs * 1e9 * MEM_BW_EFFICIENCY
        flops = self.bf16_tflops * 1e12 * FLOPS_EFFICIENCY
        compute = (2.0 * self.params * extend_tokens + 4.0 * self.num_layers * self.hidden_size * attn_pairs) / flops
        t = STEP_OVERHEAD_S + max(self.weights_bytes / bw, compute)
        t = t + num_seqs * PREFILL_PER_SEQ_S + self.num_layers * EAGER_PER_LAYER_S  # this order: the digests'
        return t + self.tp_comm_seconds(extend_tokens, num_seqs)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs, as SGLang lists them (server_args.py
    ``_generate_cuda_graph_batch_sizes``, no speculative decoding): 1, 2, 4, 8, 12, every 8 from 16 to
    256, every 16 from 272, every 32 from 512, up to ``max_bs`` (which is captured too)."""
    every = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [b for b in every if b <= max_bs]
    if max_bs > 0 and (not sizes or sizes[-1] != max_bs):
        sizes.append(max_bs)
    return sizes


def startup_seconds(weights_bytes: float, graph_max_bs: int) -> tuple[float, float, float]:
    """(weights load, CUDA-graph capture, total) in modelled seconds."""
    load = weights_bytes / (WEIGHTS_LOAD_GBS * 1e9)
    capture = len(graph_batch_sizes(graph_max_bs)) * GRAPH_CAPTURE_PER_BS_S if graph_max_bs > 0 else 0.0
    return load, capture, STARTUP_BASE_S + load + capture + WARMUP_S
