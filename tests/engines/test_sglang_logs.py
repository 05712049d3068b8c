"""SGLang log lines -> events, over every line variant SGLang has printed (0.1.x .. 0.5.23)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines.base import EventKind
from proxy.engines.sglang.logs import LogFollower, classify_death, parse_line

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


# -- Decode / Prefill statistics ---------------------------------------------------------------

DECODE_CASES = [
    pytest.param(
        "[2026-09-13 16:06:06] Decode batch, #running-req: 66, #token: 84642, token usage: 0.97, cuda graph: False, "
        "gen throughput (token/s): 2574.67, #queue-req: 11",
        {"running": 66, "used_tokens": 84642, "token_usage": 0.97, "graph": False, "gen_throughput": 2574.67, "queue": 11},
        id="0.5.23-comma",
    ),
    pytest.param(
        "Decode batch. #running-req: 233, #token: 370959, token usage: 0.82, gen throughput (token/s): 4594.01, #queue-req: 317",
        {"running": 233, "used_tokens": 370959, "token_usage": 0.82, "gen_throughput": 4594.01, "queue": 317},
        id="guide-period-no-prefix",
    ),
    pytest.param(
        "Decode batch. #running-req: 233, #token: 370959, token usage: 0.82, cuda graph: True, gen throughput (token/s): 4594.01, #queue-req: 317",
        {"running": 233, "graph": True, "queue": 317},
        id="guide-period-cuda-graph",
    ),
    pytest.param(
        "[2025-06-01 10:00:00] Decode batch, #running-req: 12, #token: 3000, token usage: 0.05, cuda graph: True, "
        "gen throughput (token/s): 800.00, #queue-req: 0, ",
        {"running": 12, "queue": 0, "token_usage": 0.05},
        id="0.5.5-trailing-comma",
    ),
    pytest.param(
        "[2025-01-01 10:00:00] Decode batch. #running-req: 7, #token: 1000, token usage: 0.50, gen throughput (token/s): 123.45, #queue-req: 3, ",
        {"running": 7, "queue": 3, "token_usage": 0.5, "gen_throughput": 123.45},
        id="0.4.10-period-trailing-comma",
    ),
    pytest.param(
        "[2026-09-13 16:06:05 TP0] Decode batch, #running-req: 5, #token: 10, token usage: 0.00, cuda graph: True, "
        "gen throughput (token/s): 10.00, #queue-req: 1",
        {"tp_rank": 0, "running": 5, "queue": 1},
        id="tp-prefix",
    ),
    pytest.param(
        "[2026-09-13 16:06:05,123 DP1 TP0] Decode batch [4100], #running-req: 5, #token: 10, token usage: 0.00, "
        "cuda graph: True, gen throughput (token/s): 10.00, #queue-req: 1",
        {"dp_rank": 1, "tp_rank": 0, "iteration": 4100, "running": 5},
        id="ms-dp-tp-iter",
    ),
    pytest.param(
        "[2026-09-13 16:06:05] Decode batch, #running-req: 40, #full token: 5000, full token usage: 0.31, #swa token: 900, "
        "swa token usage: 0.88, cuda graph: True, gen throughput (token/s): 1500.00, #queue-req: 9",
        {"used_tokens": 5000, "full_token_usage": 0.31, "swa_token_usage": 0.88, "token_usage": 0.88, "queue": 9},
        id="hybrid-swa",
    ),
    pytest.param(
        "[2026-09-13 16:06:05] Decode batch, #running-req: 40, #full token: 5000, full token usage: 0.61, mamba num: 40, "
        "mamba usage: 0.20, cuda graph: True, gen throughput (token/s): 1500.00, #queue-req: 9",
        {"mamba_used": 40, "mamba_usage": 0.2, "token_usage": 0.61},
        id="hybrid-mamba",
    ),
    pytest.param(
        "[2026-09-13 16:06:05] Decode batch, #running-req: 8, #token: 800, token usage: 0.10, accept len: 2.71, accept rate: 0.68, "
        "cuda graph: True, gen throughput (token/s): 950.12, #queue-req: 0, est. decode TFLOPS/s (per GPU): 12.30",
        {"spec_accept_len": 2.71, "spec_accept_rate": 0.68, "gen_throughput": 950.12, "queue": 0},
        id="spec-and-mfu",
    ),
    pytest.param(
        "[2026-09-13 16:06:05] Decode batch, #running-req: 8, #token: 800, token usage: 0.10, pre-allocated usage: 0.20, "
        "#prealloc-req: 2, #transfer-req: 1, #retracted-req: 0, npu graph: False, gen throughput (token/s): 90.00, #queue-req: 4",
        {"prealloc_usage": 0.2, "prealloc_queue": 2, "transfer_queue": 1, "retracted_queue": 0, "graph": False},
        id="pd-decode-npu-graph",
    ),
]


@pytest.mark.parametrize(("line", "expected"), DECODE_CASES)
def test_decode_batch_lines(line: str, expected: dict[str, object]) -> None:
    event = parse_line(line, now=5.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS
    assert event.time == 5.0 and event.line == line
    assert event.fields["phase"] == "decode"
    for key, value in expected.items():
        assert event.fields[key] == value, key


PREFILL_CASES = [
    pytest.param(
        "[2026-09-13 16:06:05] Prefill batch, #new-seq: 4, #new-token: 8192, #cached-token: 512, token usage: 0.33, "
        "#running-req: 60, #queue-req: 200, #pending-token: 30000, cuda graph: False, input throughput (token/s): 20480.50",
        {"new_seqs": 4, "new_tokens": 8192, "cached_tokens": 512, "token_usage": 0.33, "running": 60, "queue": 200,
         "pending_tokens": 30000, "graph": False, "input_throughput": 20480.5},
        id="0.5.23",
    ),
    pytest.param(
        "[2025-06-01 10:00:00] Prefill batch, #new-seq: 1, #new-token: 37, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0, ",
        {"new_seqs": 1, "new_tokens": 37, "cached_tokens": 0, "token_usage": 0.0, "running": 0, "queue": 0},
        id="0.5.5-trailing-comma",
    ),
    pytest.param(
        "[2025-01-01 10:00:00] Prefill batch. #new-seq: 2, #new-token: 640, #cached-token: 10, token usage: 0.02, #running-req: 3, #queue-req: 5, ",
        {"new_seqs": 2, "running": 3, "queue": 5},
        id="0.4.10-period",
    ),
    pytest.param(
        "[2026-09-13 16:06:05 DP0 TP0] Prefill batch, #new-seq: 4, #new-token: 100, #cached-token: 0, #full token: 5000, full token usage: 0.31, "
        "#swa token: 900, swa token usage: 0.45, #running-req: 6, #queue-req: 7, #pending-token: 0, #replay-token: 12, "
        "#bootstrap-req: 1, #inflight-req: 2, #optimistic-req: 0, cuda graph: False, input throughput (token/s): 1.00",
        {"dp_rank": 0, "token_usage": 0.45, "replay_tokens": 12, "bootstrap_queue": 1, "inflight_queue": 2, "queue": 7},
        id="pd-prefill-swa",
    ),
]


@pytest.mark.parametrize(("line", "expected"), PREFILL_CASES)
def test_prefill_batch_lines(line: str, expected: dict[str, object]) -> None:
    event = parse_line(line, now=1.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS
    assert event.fields["phase"] == "prefill"
    for key, value in expected.items():
        assert event.fields[key] == value, key


# -- retraction ----------------------------------------------------------------------------------

RETRACTION_CASES = [
    pytest.param(
        "[2026-09-13 16:06:07] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 646, "
        "#new_token_ratio: 0.0980 -> 0.3487",
        {"retracted": 1, "new_tokens_gained": 646, "new_token_ratio_before": 0.098, "new_token_ratio_after": 0.3487},
        id="0.5.23-warning",
    ),
    pytest.param(
        "[2026-09-13 16:06:07] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 100, "
        "#mamba_num_gained: 3, #new_token_ratio: 0.1000 -> 0.4000",
        {"retracted": 3, "mamba_num_gained": 3, "new_token_ratio_after": 0.4},
        id="0.5.23-mamba",
    ),
    pytest.param(
        "KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.9998 -> 1.0000",
        {"retracted": 1, "new_token_ratio_before": 0.9998, "new_token_ratio_after": 1.0},
        id="guide-0.4.10-info",
    ),
    pytest.param(
        "[2025-06-01 10:00:00 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 5, #new_token_ratio: 0.3000 -> 0.7100",
        {"retracted": 5, "tp_rank": 0},
        id="0.5.5-info-tp",
    ),
    pytest.param(
        "[2025-03-02 09:00:00] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.1474 -> 0.1845",
        {"retracted": 1, "new_token_ratio_before": 0.1474, "new_token_ratio_after": 0.1845},
        id="0.4.3-older-wording",
    ),
    pytest.param(
        "decode out of memory happened, #retracted_reqs: 1, #new_token_ratio: 0.9998 -> 1.0000",
        {"retracted": 1, "new_token_ratio_after": 1.0},
        id="0.1-very-old-wording",
    ),
    pytest.param(
        "[2026-09-13 16:06:07] Testing retraction. #retracted_reqs: 2, #new_tokens_gained: 10, #new_token_ratio: 0.5000 -> 0.6000",
        {"retracted": 2, "forced": True},
        id="test-mode",
    ),
]


@pytest.mark.parametrize(("line", "expected"), RETRACTION_CASES)
def test_retraction_lines(line: str, expected: dict[str, object]) -> None:
    event = parse_line(line, now=2.0)
    assert event is not None and event.kind is EventKind.RETRACTION
    for key, value in expected.items():
        assert event.fields[key] == value, key


def test_real_retraction_is_not_forced() -> None:
    event = parse_line(RETRACTION_CASES[0].values[0], now=0.0)  # type: ignore[arg-type]
    assert event is not None and "forced" not in event.fields


# -- start-up, readiness, capacity ---------------------------------------------------------------


def test_startup_line_gpu() -> None:
    line = (
        "[2025-08-11 17:17:03] max_total_num_tokens=665690, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=4096, context_len=65536, available_gpu_mem=13.50 GB"
    )
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.STARTUP
    assert dict(event.fields) == {
        "max_total_tokens": 665690,
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "max_running_requests": 4096,
        "context_len": 65536,
        "available_gpu_mem_gb": 13.5,
    }


def test_startup_line_cpu_and_disabled_chunking() -> None:
    line = (
        "[2026-09-13 16:00:00 TP0] max_total_num_tokens=8192, chunked_prefill_size=-1, max_prefill_tokens=16384, "
        "max_running_requests=128, context_len=2048, available_cpu_mem=3.25 GB"
    )
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.STARTUP
    assert event.fields["chunked_prefill_size"] == -1
    assert event.fields["available_cpu_mem_gb"] == 3.25 and event.fields["device"] == "cpu"
    assert "available_gpu_mem_gb" not in event.fields and event.fields["tp_rank"] == 0


def test_ready_line() -> None:
    event = parse_line("[2026-09-13 16:01:00] The server is fired up and ready to roll!", now=3.0)
    assert event is not None and event.kind is EventKind.READY


def test_kv_pool_smaller_than_context_warning() -> None:
    line = "[2026-09-13 16:00:00 TP0] KV pool holds 4096 tokens, fewer than --context-length 32768. Requests longer than that will be rejected."
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.KV_CAPACITY_ERROR
    assert event.fields["kv_tokens"] == 4096 and event.fields["context_len"] == 32768


# -- out of memory and crashes (single lines) ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "phase", "cause"),
    [
        pytest.param("[2026-09-13 16:20:11] Prefill out of memory. Try to lower your batch size.", "prefill", "kv_pool", id="prefill-alloc"),
        pytest.param("[2026-09-13 16:20:11] Decode out of memory. Try to lower your batch size.", "decode", "kv_pool", id="decode-alloc"),
        pytest.param(
            "[2026-09-13 16:20:11] alloc_req_slots runs out of memory. Please set a smaller number for `--max-running-requests`. "
            "req_to_token_pool.available_size()=0, num_reqs=4",
            "decode",
            "request_slots",
            id="req-slots",
        ),
    ],
)
def test_allocator_oom_lines(line: str, phase: str, cause: str) -> None:
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.OOM
    assert event.fields["phase"] == phase and event.fields["cause"] == cause


def test_retraction_wording_is_not_an_allocator_oom() -> None:
    event = parse_line("Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.1 -> 0.2", now=0.0)
    assert event is not None and event.kind is EventKind.RETRACTION


def test_exception_head_alone_is_a_crash_of_unknown_phase() -> None:
    event = parse_line("[2026-09-13 16:10:02] Scheduler hit an exception: Traceback (most recent call last):", now=0.0)
    assert event is not None and event.kind is EventKind.CRASH
    assert event.fields["process"] == "Scheduler" and event.fields["phase"] == "unknown"


def test_watchdog_crash() -> None:
    event = parse_line("[2026-09-13 16:10:02] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)", now=0.0)
    assert event is not None and event.kind is EventKind.CRASH and event.fields["cause"] == "watchdog"


@pytest.mark.parametrize(
    "line",
    [
        "",
        "[2026-09-13 16:00:00] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=60.12 GB, mem usage=14.99 GB.",
        'INFO:     127.0.0.1:51234 - "GET /health HTTP/1.1" 200 OK',
        "[2026-09-13 16:00:00] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
        "Try to allocate 4096 tokens.",
        "[2026-09-13 16:00:00] Decode batches are slow today",
    ],
)
def test_lines_without_events(line: str) -> None:
    assert parse_line(line, now=0.0) is None


# -- crashes with tracebacks: the follower ------------------------------------------------------


def test_follower_prefill_cuda_oom() -> None:
    follower = LogFollower()
    events = follower.feed_all(fixture_lines("sglang_crash_prefill_cuda_oom.log"), now=10.0)
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.BATCH_STATS, EventKind.OOM, EventKind.CRASH]
    oom, crash = events[1], events[2]
    assert oom.fields["phase"] == "prefill" and crash.fields["phase"] == "prefill"
    assert crash.fields["phase_source"] == "traceback" and crash.fields["oom"] is True
    assert crash.fields["cause"] == "device_memory"
    assert str(crash.fields["exception"]).startswith("torch.OutOfMemoryError: CUDA out of memory")


def test_follower_decode_cuda_oom_after_flush() -> None:
    follower = LogFollower()
    lines = fixture_lines("sglang_crash_decode_cuda_oom.log")
    events = follower.feed_all(lines[:-1], now=0.0)  # the block is still open: no crash yet
    assert [e.kind for e in events] == [EventKind.BATCH_STATS]
    events = follower.flush(now=1.0)
    assert [e.kind for e in events] == [EventKind.OOM, EventKind.CRASH]
    assert events[0].fields["phase"] == "decode" and events[0].fields["tp_rank"] == 0
    assert follower.flush(now=2.0) == []


def test_follower_allocator_oom_reported_once() -> None:
    follower = LogFollower()
    events = follower.feed_all(fixture_lines("sglang_crash_prefill_allocator.log"), now=0.0) + follower.flush(now=0.0)
    assert [e.kind for e in events] == [EventKind.BATCH_STATS, EventKind.OOM, EventKind.CRASH]
    assert events[2].fields["phase"] == "prefill" and events[2].fields["cause"] == "kv_pool"


def test_follower_non_oom_crash() -> None:
    follower = LogFollower()
    events = follower.feed_all(fixture_lines("sglang_crash_value_error.log"), now=0.0)
    assert [e.kind for e in events] == [EventKind.READY, EventKind.BATCH_STATS, EventKind.CRASH]
    crash = events[-1]
    assert crash.fields["oom"] is False and crash.fields["phase"] == "unknown"
    assert crash.fields["exception"] == "ValueError: invalid sampling parameter: top_p must be in (0, 1]"


def test_follower_oom_without_phase_in_traceback_uses_last_batch() -> None:
    lines = [
        "[2026-09-13 16:12:40] Decode batch, #running-req: 9, #token: 1, token usage: 0.50, cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0",
        "[2026-09-13 16:12:41] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "x.py", line 1, in somewhere',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
    ]
    follower = LogFollower()
    events = follower.feed_all(lines, now=0.0) + follower.flush(now=0.0)
    crash = events[-1]
    assert crash.fields["phase"] == "decode" and crash.fields["phase_source"] == "last_batch"


@pytest.mark.parametrize(
    ("name", "cause", "phase", "started"),
    [
        pytest.param("sglang_crash_prefill_cuda_oom.log", "oom", "prefill", False, id="prefill-cuda"),
        pytest.param("sglang_crash_decode_cuda_oom.log", "oom", "decode", False, id="decode-cuda"),
        pytest.param("sglang_crash_prefill_allocator.log", "oom", "prefill", False, id="prefill-alloc"),
        pytest.param("sglang_crash_value_error.log", "crash", "unknown", True, id="value-error"),
    ],
)
def test_classify_death(name: str, cause: str, phase: str, started: bool) -> None:
    death = classify_death(fixture_lines(name))
    assert (death.cause, death.phase, death.started) == (cause, phase, started)
    assert death.detail


def test_classify_death_without_evidence() -> None:
    death = classify_death(["[2026-09-13 16:00:00] Load weight begin.", "Killed"])
    assert death.cause == "unknown" and death.detail == "Killed"
    assert classify_death([]).cause == "unknown"
