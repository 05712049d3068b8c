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

Scheduling with ``lpm`` (SGLang's ``SchedulePolicy.calc_priority``, each round that tries to admit
while at most 128 wait) walks the radix tree for every waiting request (``match_prefix``, a Python
loop over each matched token: ``_key_match_page_size1``) and, for one whose cached prefix is short,
the waiting queue's own tree (a match and an insert over its whole prompt); ``fcfs`` skips it. The
round's CPU time is added to the step it schedules::

    lpm round = waiting x LPM_PER_REQ_S + tokens walked x LPM_PER_TOKEN_S

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

    def decode_seconds(self, batch_size: int, kv_tokens: int, cuda_graph: bool) -> float:
        bw = self.bandwidth_gbs * 1e9 * MEM_BW_EFFICIENCY
        t = STEP_OVERHEAD_S + (self.weights_bytes + kv_tokens * self.kv_bytes_per_token) / bw
        t += batch_size * DECODE_PER_SEQ_S
        if not cuda_graph:
            t += self.num_layers * EAGER_PER_LAYER_S
        return t

    def prefill_seconds(self, extend_tokens: int, attn_pairs: float, num_seqs: int) -> float:
        bw = self.bandwidth_gbs * 1e9 * MEM_BW_EFFICIENCY
        flops = self.bf16_tflops * 1e12 * FLOPS_EFFICIENCY
        compute = (2.0 * self.params * extend_tokens + 4.0 * self.num_layers * self.hidden_size * attn_pairs) / flops
        t = STEP_OVERHEAD_S + max(self.weights_bytes / bw, compute)
        return t + num_seqs * PREFILL_PER_SEQ_S + self.num_layers * EAGER_PER_LAYER_S


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
