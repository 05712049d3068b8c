"""Our log lines against the reference's real SGLang lines, and through the project's own parser."""

from __future__ import annotations

import asyncio
import re

from proxy.engines.base import EventKind
from proxy.engines.sglang.logs import classify_death, parse_line
from proxy.sim import logs
from proxy.sim.logs import LogSink

REAL_DECODE = (
    "Decode batch, #running-req: 66, #token: 84642, token usage: 0.97, cuda graph: False, "
    "gen throughput (token/s): 2574.67, #queue-req: 11"
)
REAL_RETRACT = (
    "KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 646, "
    "#new_token_ratio: 0.0980 -> 0.3487"
)
REAL_STARTUP = (
    "max_total_num_tokens=665690, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=4096, context_len=65536, available_gpu_mem=13.50 GB"
)


def test_decode_line_is_sglangs() -> None:
    assert (
        logs.decode_line(
            running=66, used_tokens=84642, token_usage=0.9712, cuda_graph=False, gen_throughput=2574.671, queue=11
        )
        == REAL_DECODE
    )


def test_retract_line_is_sglangs() -> None:
    assert logs.retract_line(1, 646, 0.098, 0.34866) == REAL_RETRACT


def test_startup_line_is_sglangs() -> None:
    assert (
        logs.startup_line(
            max_total_num_tokens=665690,
            chunked_prefill_size=8192,
            max_prefill_tokens=16384,
            max_running_requests=4096,
            context_len=65536,
            available_gpu_mem_gb=13.5,
        )
        == REAL_STARTUP
    )


def test_prefill_line_has_0_5_23_fields_in_order() -> None:
    line = logs.prefill_line(
        new_seq=3,
        new_token=2048,
        cached_token=512,
        token_usage=0.25,
        running=10,
        queue=4,
        pending_token=900,
        cuda_graph=False,
        input_throughput=12345.678,
    )
    assert line == (
        "Prefill batch, #new-seq: 3, #new-token: 2048, #cached-token: 512, token usage: 0.25, "
        "#running-req: 10, #queue-req: 4, #pending-token: 900, cuda graph: False, "
        "input throughput (token/s): 12345.68"
    )
    ev = parse_line("[2026-09-13 16:06:05] " + line, 0.0)
    assert ev is not None and ev.kind is EventKind.BATCH_STATS
    assert ev.fields["cached_tokens"] == 512 and ev.fields["queue"] == 4


def test_sink_prefix_and_parser_round_trip() -> None:
    import io

    buf = io.StringIO()
    sink = LogSink(buf, clock=lambda: 1_789_000_000.0)
    sink("info", REAL_DECODE)
    sink("warning", REAL_RETRACT)
    sink("info", REAL_STARTUP)
    sink("info", logs.READY_LINE)
    lines = buf.getvalue().splitlines()
    assert all(re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \S", line) for line in lines)
    kinds = [parse_line(line, 0.0).kind for line in lines]
    assert kinds == [EventKind.BATCH_STATS, EventKind.RETRACTION, EventKind.STARTUP, EventKind.READY]
    assert parse_line(lines[2], 0.0).fields["available_gpu_mem_gb"] == 13.5


def test_oom_tracebacks_tell_prefill_from_decode() -> None:
    for phase in ("prefill", "decode"):
        text = logs.cuda_oom_traceback(phase=phase, need_mib=2048, total_mib=10240, free_mib=500, used_mib=9000)
        lines = [*("[2026-09-13 16:06:05] " + text).splitlines(), "[2026-09-13 16:06:05] " + logs.SIGQUIT_LINE]
        death = classify_death(lines)
        assert (death.cause, death.phase) == ("oom", phase)


def test_a_tensor_parallel_worker_speaks_as_rank_0_of_its_own_gpu() -> None:
    # SGLang with --tp-size > 1 prefixes its scheduler's lines with the rank, and each rank reports
    # the memory of its own GPU: a 70B model at tp 4 on H100s shows a quarter of the weights and the
    # KV pool per GPU, never the four GPUs' sum
    import io

    from proxy.sim.startup import start_up
    from tests.sim.helpers import config

    def lines_of(*argv: str) -> list[str]:
        buf = io.StringIO()
        cfg = config("--sim-model", "llama-3.1-70b", "--sim-gpu", "h100-80gb", "--sim-startup-seconds", "0", *argv)
        asyncio.run(start_up(cfg, LogSink(buf, rank_prefix=" TP0" if cfg.tp_size > 1 else "")))
        return buf.getvalue().splitlines()

    four = lines_of("--tp-size", "4")
    assert all(re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] \S", line) for line in four)
    events = [e for e in (parse_line(line, 0.0) for line in four) if e is not None]
    startup = [e for e in events if e.kind is EventKind.STARTUP and "available_gpu_mem_gb" in e.fields]
    assert startup and all(e.fields["tp_rank"] == 0 and 0 < e.fields["available_gpu_mem_gb"] < 80 for e in startup)
    weights = next(line for line in four if "Load weight end" in line)
    gb = float(re.search(r"mem usage=([\d.]+) GB", weights).group(1))  # type: ignore[union-attr]
    assert 30 < gb < 36  # 70B x 2 bytes / 4 GPUs, not 131 GB
    free = [float(x) for line in four for x in re.findall(r"avail mem=([\d.]+) GB", line)]
    assert free and all(0 < f <= 80 for f in free) and free == sorted(free, reverse=True)
