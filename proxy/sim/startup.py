"""The start-up a real server goes through, with its log lines, in modelled time.

The modelled start-up is the whole of it, a real server's interpreter start and imports included:
the time this process took to get here (its own interpreter and imports) is taken off the first
phase, so a restart costs the modelled time and not that plus this process's start-up times the
time scale (0.3 s of imports at time scale 16 would be 5 modelled seconds more per restart).

Process start and imports, weights from disk, the KV pool, CUDA-graph capture, warm-up: each phase
takes its modelled share of ``SimConfig.startup_wall_seconds`` (see :func:`steptime.startup_seconds`),
so a restart costs what it costs on a GPU (divided by the time scale).
"""

from __future__ import annotations

import asyncio
import os

from proxy.sim import logs
from proxy.sim.config import SimConfig
from proxy.sim.steptime import graph_batch_sizes, startup_seconds


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0.0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            after_comm = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_comm[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


def capacity_line(cfg: SimConfig) -> str:
    """The start-up line that says what the server resolved: KV pool, prefill chunk, running cap, free memory."""
    return logs.startup_line(
        max_total_num_tokens=cfg.max_total_num_tokens,
        chunked_prefill_size=cfg.chunked_prefill_size or -1,
        max_prefill_tokens=cfg.max_prefill_tokens,
        max_running_requests=cfg.max_running_requests,
        context_len=cfg.context_len,
        available_gpu_mem_gb=cfg.memory.available_gb,
    )


async def start_up(cfg: SimConfig, sink: logs.LogSink) -> None:
    """Log and wait through start-up; returns once the server is ready (the last line says so)."""
    mem, say = cfg.memory, sink
    load_s, capture_s, total_s = startup_seconds(cfg.weights_bytes, cfg.cuda_graph_max_bs_decode)
    k = cfg.startup_wall_seconds / total_s if total_s > 0 else 0.0  # real seconds per modelled second
    # each rank reports its own GPU: with tensor parallelism the weights, the KV pool and the rest
    # are spread evenly over tp GPUs, so rank 0 sees a tp-th of each
    per_gpu = 1024 * cfg.tp_size
    free0 = (mem.total_mib - mem.context_mib) / per_gpu
    say(
        "info",
        f"server_args=ServerArgs(model_path='{cfg.model_path}', served_model_name='{cfg.served_model_name}', "
        f"host='{cfg.host}', port={cfg.port}, mem_fraction_static={cfg.mem_fraction_static}, "
        f"max_running_requests={cfg.max_running_requests}, max_queued_requests={cfg.max_queued_requests}, "
        f"max_total_tokens={cfg.server_args.get('max_total_tokens')}, "
        f"chunked_prefill_size={cfg.chunked_prefill_size or -1}, max_prefill_tokens={cfg.max_prefill_tokens}, "
        f"schedule_policy='{cfg.schedule_policy}', schedule_conservativeness={cfg.schedule_conservativeness}, "
        f"cuda_graph_max_bs_decode={cfg.cuda_graph_max_bs_decode}, enable_metrics={cfg.enable_metrics}, "
        f"decode_log_interval={cfg.decode_log_interval}, context_length={cfg.context_len})",
    )
    await asyncio.sleep(max(0.0, k * (total_s - load_s - capture_s - 1.0) - process_age_s()))
    say("info", f"Load weight begin. avail mem={free0:.2f} GB")
    await asyncio.sleep(k * load_s)
    after_w = free0 - mem.weights_mib / per_gpu
    say(
        "info",
        f"Load weight end. type={cfg.model.architecture}, dtype=torch.bfloat16, avail mem={after_w:.2f} GB, "
        f"mem usage={mem.weights_mib / per_gpu:.2f} GB.",
    )
    kv_half = mem.kv_pool_mib / (2 * per_gpu)
    say(
        "info",
        f"KV Cache is allocated. #tokens: {cfg.max_total_num_tokens}, K size: {kv_half:.2f} GB, "
        f"V size: {kv_half:.2f} GB",
    )
    after_kv = after_w - mem.kv_pool_mib / per_gpu
    say("info", f"Memory pool end. avail mem={after_kv:.2f} GB")
    if cfg.cuda_graph_max_bs_decode > 0:
        say("info", f"Capture cuda graph begin. This can take up to several minutes. avail mem={after_kv:.2f} GB")
        say("info", f"Capture cuda graph bs {graph_batch_sizes(cfg.cuda_graph_max_bs_decode)}")
        await asyncio.sleep(k * capture_s)
        say(
            "info",
            f"Capture cuda graph end. Time elapsed: {capture_s:.2f} s. mem usage={mem.graph_mib / per_gpu:.2f} GB. "
            f"avail mem={mem.available_mib / per_gpu:.2f} GB.",
        )
    if cfg.max_total_num_tokens < cfg.context_len:
        say(
            "warning",
            f"KV pool holds {cfg.max_total_num_tokens} tokens, fewer than --context-length "
            f"{cfg.context_len}. Requests longer than the pool are rejected.",
        )
    say("info", capacity_line(cfg))
    await asyncio.sleep(k * 1.0)  # warm-up request
    say("info", logs.READY_LINE)
