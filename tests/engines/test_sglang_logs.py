"""SGLang log lines -> events, over every line variant SGLang has printed (0.1.x .. 0.5.23)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines.base import EventKind
from proxy.engines.sglang.logs import LogFollower, classify_death, parse_line
from tests.engines.issue_lines import IssueLine, issue_lines, params, traceback_lines

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


# -- Decode / Prefill statistics ---------------------------------------------------------------

DECODE_CASES = [
    pytest.param(
        "[2026-09-13 16:06:06] Decode batch, #running-req: 66, #token: 84642, token usage: 0.97, cuda graph: False, "
        "gen throughput (token/s): 2574.67, #queue-req: 11",
        {
            "running": 66,
            "used_tokens": 84642,
            "token_usage": 0.97,
            "graph": False,
            "gen_throughput": 2574.67,
            "queue": 11,
        },
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
        {
            "new_seqs": 4,
            "new_tokens": 8192,
            "cached_tokens": 512,
            "token_usage": 0.33,
            "running": 60,
            "queue": 200,
            "pending_tokens": 30000,
            "graph": False,
            "input_throughput": 20480.5,
        },
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
        "available_gpu_mem_rounding_gb": 0.005,  # printed to 2 places: the true figure within half the last
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
        pytest.param(
            "[2026-09-13 16:20:11] Prefill out of memory. Try to lower your batch size.",
            "prefill",
            "kv_pool",
            id="prefill-alloc",
        ),
        pytest.param(
            "[2026-09-13 16:20:11] Decode out of memory. Try to lower your batch size.",
            "decode",
            "kv_pool",
            id="decode-alloc",
        ),
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
    event = parse_line(
        "[2026-09-13 16:10:02] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)", now=0.0
    )
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


# -- the versions people run: lines from the issue tracker (tests/engines/fixtures/*.txt) --------

OLD_STATS = {  # id -> fields the line must give (every line also gives the controller's running/queue)
    "0.2-time-prefix-decode": {"phase": "decode", "tp_rank": 0, "running": 2, "used_tokens": 4078, "token_usage": 0.0,
                               "gen_throughput": 447.31, "queue": 0},
    "0.2-gpu-prefix-decode": {"gpu_id": 0, "running": 381, "token_usage": 0.96, "gen_throughput": 93.97, "queue": 1549},
    "0.2-no-prefix-decode": {"running": 1010, "token_usage": 0.93, "queue": 12279},
    "0.4-decode": {"tp_rank": 0, "running": 8, "token_usage": 0.12, "gen_throughput": 186.64, "queue": 0},
    "0.4-largest-len-decode": {"running": 509, "used_tokens": 180776, "token_usage": 0.43, "queue": 0},
    "0.4-cuda-graph-decode": {"running": 1, "graph": True, "gen_throughput": 1.06, "queue": 0},
    "0.5-decode-trailing-comma": {"running": 6, "token_usage": 0.94, "queue": 5},
    "0.3-prefill-cache-hit-rate": {"phase": "prefill", "new_seqs": 2, "new_tokens": 2048, "cached_tokens": 2048,
                                   "cache_hit_rate": 0.0, "token_usage": 0.0, "running": 1, "queue": 30},
    "0.3-time-prefix-prefill": {"phase": "prefill", "tp_rank": 0, "cache_hit_rate": 0.0276, "token_usage": 0.04,
                                "running": 1, "queue": 38},
    "0.4-prefill-trailing-comma": {"new_seqs": 1, "cached_tokens": 1, "running": 0, "queue": 0},
    "0.4-prefill-no-rank": {"new_tokens": 2, "cached_tokens": 8027, "token_usage": 0.26, "running": 28, "queue": 0},
    "0.1-head-less-decode": {"phase": "decode", "running": 5, "used_tokens": 1938, "token_usage": 0.24, "queue": 0},
    "0.1-new-fill-batch-trailing-period": {"phase": "prefill", "new_seqs": 1, "cached_tokens": 757, "new_tokens": 1,
                                           "queue": 4, "running": 2, "cache_hit_rate": 0.8083},
    "0.1-new-fill-batch": {"phase": "prefill", "new_seqs": 1, "cached_tokens": 330, "new_tokens": 2172, "queue": 57,
                           "running": 9, "cache_hit_rate": 0.6916},
    "0.1-new-fill-batch-no-hit-rate": {"new_seqs": 7, "cached_tokens": 1541, "new_tokens": 4, "queue": 0, "running": 0},
    "0.1-new-fill-batch-fsm": {"new_seqs": 1, "cache_hit_rate": 0.6218, "queue": 0, "running": 0},
}  # fmt: skip


@pytest.mark.parametrize("item", params("sglang_old_lines.txt"))
def test_old_statistics_lines(item: IssueLine) -> None:
    event = parse_line(item.line, now=4.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS, item.source
    assert isinstance(event.fields["running"], int) and isinstance(event.fields["queue"], int)
    for key, value in OLD_STATS[item.tags["id"]].items():
        assert event.fields[key] == value, key


def test_every_old_statistics_line_has_expectations() -> None:
    assert {item.tags["id"] for item in issue_lines("sglang_old_lines.txt")} == set(OLD_STATS)


def test_old_lines_feed_the_window_as_the_newest_do() -> None:
    follower = LogFollower()
    events = follower.feed_all([item.line for item in issue_lines("sglang_old_lines.txt")], now=0.0)
    assert len(events) == len(OLD_STATS) and all(e.kind is EventKind.BATCH_STATS for e in events)
    assert follower.flush(now=0.0) == []


@pytest.mark.parametrize("item", params("sglang_old_retractions.txt"))
def test_old_retraction_lines(item: IssueLine) -> None:
    event = parse_line(item.line, now=0.0)
    assert event is not None and event.kind is EventKind.RETRACTION
    assert event.fields["retracted"] == 1 and "forced" not in event.fields
    assert isinstance(event.fields["tp_rank"], int)
    assert event.fields["new_token_ratio_after"] > event.fields["new_token_ratio_before"]


def test_head_less_decode_line_of_0_1() -> None:
    # Built from the format string of python/sglang/srt/managers/router/model_rpc.py (0.1.x), which logged the
    # statistics without a head: f"#running-req: {..}, #token: {..}, token usage: {..:.2f}, gen throughput
    # (token/s): {..:.2f}, #queue-req: {..}"; no issue quotes one.
    event = parse_line(
        "#running-req: 12, #token: 5120, token usage: 0.07, gen throughput (token/s): 310.55, #queue-req: 3", now=0.0
    )
    assert event is not None and event.kind is EventKind.BATCH_STATS
    assert (event.fields["phase"], event.fields["running"], event.fields["queue"], event.fields["token_usage"]) == (
        "decode",
        12,
        3,
        0.07,
    )


def test_mixed_chunk_prefill_line() -> None:
    # Built from the format string of python/sglang/srt/managers/tp_worker.py (0.2.x) for a mixed chunked prefill.
    line = "[11:02:03 TP0] Prefill batch(mixed #running-req: 17). #new-seq: 1, #new-token: 2048, #cached-token: 0, cache hit rate: 0.00%, #queue-req: 4"
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS
    assert (event.fields["phase"], event.fields["running"], event.fields["queue"], event.fields["mixed"]) == (
        "prefill",
        17,
        4,
        True,
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # The format of python/sglang/srt/managers/router/model_rpc.py (0.1.x); sgl-project/sglang#138 quotes the
        # capitalised "Rank 1: Max_total_num_token=115621, ..." of one build.
        pytest.param("Rank 0: max_total_num_token=75833, max_prefill_num_token=12632, context_len=4096, ",
                     {"max_total_tokens": 75833, "max_prefill_tokens": 12632, "context_len": 4096}, id="0.1"),
        pytest.param("[gpu_id=0] max_total_num_tokens=423600, max_prefill_tokens=16384, max_running_requests=2047, context_len=8192",
                     {"gpu_id": 0, "max_total_tokens": 423600, "max_running_requests": 2047}, id="0.2-gpu-id"),
    ],
)  # fmt: skip
def test_old_startup_lines(line: str, expected: dict[str, object]) -> None:
    event = parse_line(line, now=0.0)
    assert event is not None and event.kind is EventKind.STARTUP
    assert dict(event.fields).items() >= expected.items()


@pytest.mark.parametrize(
    "line",
    [  # sgl-project/sglang#105 (0.1.x), verbatim: the leak check names the capacity too
        " UserWarning: Warning: available_size=35244, max_total_num_token=42308",
        "KV cache pool leak detected!",
    ],
)
def test_kv_leak_warning_is_no_startup_line(line: str) -> None:
    assert parse_line(line, now=0.0) is None


def test_memory_pool_end_line_of_the_tracker() -> None:
    # The first line is verbatim from sgl-project/sglang#11716; the capacity line is the 0.2-0.4 format (no
    # available_gpu_mem of its own).
    lines = ["[2025-10-16 09:06:22 TP5] Memory pool end. avail mem=11.87 GB",
             "[2025-10-16 09:06:23 TP5] max_total_num_tokens=2795207, max_prefill_tokens=16384, max_running_requests=4096, context_len=163840"]  # fmt: skip
    assert parse_line(lines[0], now=0.0) is None
    (startup,) = LogFollower().feed_all(lines, now=0.0)
    assert startup.kind is EventKind.STARTUP and startup.fields["tp_rank"] == 5
    assert (
        startup.fields["available_gpu_mem_gb"] == 11.87 and startup.fields["available_mem_source"] == "avail_mem_line"
    )


def test_memory_pool_end_gives_the_capacity_line_its_free_memory() -> None:
    # The format of model_runner.py init_memory_pool ("Memory pool end. avail mem=%.2f GB") and the capacity
    # line of the versions before available_gpu_mem was added to it (0.2-0.4).
    lines = [
        "[2025-01-01 10:00:00 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=60.12 GB",
        "[2025-01-01 10:00:01 TP0] Memory pool end. avail mem=9.68 GB",
        "[2025-01-01 10:00:05 TP0] Capture cuda graph end. Time elapsed: 3.10 s. avail mem=8.91 GB",
        "[2025-01-01 10:00:05 TP0] max_total_num_tokens=423600, max_prefill_tokens=16384, max_running_requests=2047, context_len=8192",
    ]
    assert parse_line(lines[1], now=0.0) is None  # no event of its own: the follower keeps the figure
    startup = [e for e in LogFollower().feed_all(lines, now=0.0) if e.kind is EventKind.STARTUP][-1]
    assert startup.fields["max_total_tokens"] == 423600
    assert startup.fields["available_gpu_mem_gb"] == 8.91 and startup.fields["available_mem_source"] == "avail_mem_line"


def test_newer_capacity_line_keeps_its_own_free_memory() -> None:
    lines = ["[2025-08-11 17:17:02] Memory pool end. avail mem=20.00 GB",
             "[2025-08-11 17:17:03] max_total_num_tokens=665690, context_len=65536, available_gpu_mem=13.50 GB"]  # fmt: skip
    startup = LogFollower().feed_all(lines, now=0.0)[-1]
    assert startup.fields["available_gpu_mem_gb"] == 13.5 and "available_mem_source" not in startup.fields


# -- device OOM in every wording, in the death classifier ----------------------------------------


def _scheduler_crash(exception_line: str, frame: str) -> list[str]:
    # The head and the frames are SGLang's (0.4+); the exception line is verbatim from the issue tracker.
    return [
        "[2026-09-13 16:12:41 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/usr/lib/python3/site-packages/sglang/srt/managers/scheduler.py", line 1380, in event_loop_normal',
        f'  File "/usr/lib/python3/site-packages/sglang/srt/model_executor/model_runner.py", line 2188, in {frame}',
        exception_line,
        "[2026-09-13 16:12:41] Received sigquit from a child process. It usually means the child failed.",
    ]


@pytest.mark.parametrize("item", params("oom_lines.txt"))
@pytest.mark.parametrize(("frame", "phase"), [("forward_extend", "prefill"), ("forward_decode", "decode")])
def test_device_oom_wordings_in_a_scheduler_traceback(item: IssueLine, frame: str, phase: str) -> None:
    death = classify_death(_scheduler_crash(item.line, frame))
    expected_phase = "prefill" if "batch_prefill_tmp" in item.line else phase  # the innermost marker wins
    assert (death.cause, death.phase) == ("oom", expected_phase), item.source
    follower = LogFollower()
    events = follower.feed_all(_scheduler_crash(item.line, frame), now=0.0) + follower.flush(now=0.0)
    (oom,) = [e for e in events if e.kind is EventKind.OOM]
    assert oom.fields["cause"] == item.tags["cause"] and oom.fields["tp_rank"] == 0


def test_not_out_of_memory_cuda_errors_are_crashes() -> None:
    # A cuBLAS failure that is not an allocation failure: the error of vllm-project/vllm#18335 as its title quotes it,
    # with the "RuntimeError: " PyTorch raises it as.
    line = "RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`"
    death = classify_death(_scheduler_crash(line, "forward_decode"))
    assert death.cause == "crash" and death.detail == line


@pytest.mark.parametrize(
    ("name", "phase", "cause"),
    [
        pytest.param(
            "sglang_0.3_flashinfer_prefill.txt", "prefill", "flashinfer_workspace", id="0.3-rank-prefixed-traceback"
        ),
        pytest.param(
            "sglang_0.1_flashinfer_decode.txt", "decode", "flashinfer_workspace", id="0.1-cuda-error-before-traceback"
        ),
    ],
)
def test_old_scheduler_tracebacks(name: str, phase: str, cause: str) -> None:
    lines = traceback_lines(name)
    death = classify_death(lines)
    assert (death.cause, death.phase) == ("oom", phase)
    follower = LogFollower()
    events = follower.feed_all(lines, now=0.0) + follower.flush(now=0.0)
    assert [e.kind for e in events] == [EventKind.OOM, EventKind.CRASH]
    assert events[0].fields["cause"] == cause and events[1].fields["phase_source"] == "traceback"


def test_device_oom_without_a_traceback_comes_out_at_exit() -> None:
    lines = [
        "[2026-09-13 16:12:40 TP0] Decode batch, #running-req: 9, #token: 1, token usage: 0.50, cuda graph: True, gen throughput (token/s): 1.00, #queue-req: 0",
        issue_lines("oom_lines.txt")[8].line,  # NCCL's "Cuda failure 'out of memory'"
    ]
    follower = LogFollower()
    assert [e.kind for e in follower.feed_all(lines, now=0.0)] == [EventKind.BATCH_STATS]
    (oom,) = follower.flush(now=1.0)
    assert oom.kind is EventKind.OOM and oom.fields["cause"] == "nccl"
    assert oom.fields["phase"] == "decode" and oom.fields["phase_source"] == "last_batch"
    assert classify_death(lines).cause == "oom"


def test_traceback_block_of_an_unprefixed_log_ends_at_the_next_statistics_line() -> None:
    # 0.1.x logged without a prefix (sgl-project/sglang#55): the statistics after a traceback are not part of it.
    lines = ["Exception in ModelRpcClient:", "Traceback (most recent call last):",
             '  File "/sglang/python/sglang/srt/managers/router/model_rpc.py", line 145, in forward_step',
             "RuntimeError: Trying to create tensor with negative dimension -1: [-1]",
             issue_lines("sglang_old_lines.txt")[-2].line]  # fmt: skip
    events = LogFollower().feed_all(lines, now=0.0)
    assert [e.kind for e in events] == [EventKind.CRASH, EventKind.BATCH_STATS]
    assert events[0].fields["exception"] == "RuntimeError: Trying to create tensor with negative dimension -1: [-1]"


def test_time_only_prefix_ends_a_traceback_block_and_names_the_rank() -> None:
    # sgl-project/sglang#1304: "[14:47:01 TP0] Exception in ModelTpServer:" (0.2.15)
    lines = ["[14:47:01 TP0] Exception in ModelTpServer:", "Traceback (most recent call last):",
             '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/managers/tp_worker.py", line 507, in forward_prefill_batch',
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
             issue_lines("sglang_old_lines.txt")[0].line]  # fmt: skip
    events = LogFollower().feed_all(lines, now=0.0)
    assert [e.kind for e in events] == [EventKind.OOM, EventKind.CRASH, EventKind.BATCH_STATS]
    assert events[0].fields["phase"] == "prefill" and events[1].fields["tp_rank"] == 0


_ALLOCATOR = (
    "[W1122 13:45:07.144601916 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 "
    "while trying to allocate 7516192768 bytes (free: 1547173888, total: 85029158912)."
)
_READY = "[2026-09-13 16:10:01] The server is fired up and ready to roll!"
_DECODE = (
    "[2026-09-13 16:12:40 TP0] Decode batch, #running-req: 64, #token: 90112, token usage: 0.96, cuda graph: True, "
    "gen throughput (token/s): 2911.40, #queue-req: 12"
)


@pytest.mark.parametrize(("frame", "phase"), [("forward_extend", "prefill"), ("forward_decode", "decode")])
def test_the_driver_apis_out_of_memory_in_a_scheduler_traceback(frame: str, phase: str) -> None:
    death = classify_death(
        [_READY, _DECODE, *_scheduler_crash("RuntimeError: CUDA driver error: out of memory", frame)]
    )
    assert (death.cause, death.phase) == ("oom", phase)


def test_the_allocators_failed_first_try_is_no_event_but_explains_a_death_nothing_else_does() -> None:
    assert parse_line(_ALLOCATOR, now=0.0) is None  # it frees its cache and tries again: no OOM yet
    follower = LogFollower()
    assert [e.kind for e in follower.feed_all([_READY, _ALLOCATOR, _DECODE], now=0.0) + follower.flush(0.0)] == [
        EventKind.READY,
        EventKind.BATCH_STATS,
    ]
    death = classify_death([_READY, _DECODE, _ALLOCATOR])  # the process was gone after it, with no other word
    assert (death.cause, death.detail, death.started) == ("oom", _ALLOCATOR, True)
    # a crash that says what it was is that; a warning before a restart says nothing of the next run's end
    crash = classify_death([_READY, _ALLOCATOR, *_scheduler_crash("ValueError: bad input", "forward_decode")])
    assert crash.cause == "crash"
    assert classify_death([_ALLOCATOR, _READY, _DECODE]).cause == "unknown"
