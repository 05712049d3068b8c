"""vLLM log lines -> events, over the reference's lines verbatim and lines recorded from a real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines.base import EventKind
from proxy.engines.vllm.logs import LogFollower, classify_death, parse_line
from tests.engines.issue_lines import IssueLine, issue_lines, params, traceback_lines

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param(
            "(APIServer pid=1) INFO 03-09 12:56:57 [loggers.py:236] Engine 000: Avg prompt throughput: 812.3 tokens/s, "
            "Avg generation throughput: 5763.0 tokens/s, Running: 29 reqs, Waiting: 47 reqs, GPU KV cache usage: 98.4%, "
            "Prefix cache hit rate: 0.0%",
            {
                "running": 29,
                "queue": 47,
                "token_usage": 0.984,
                "gen_throughput": 5763.0,
                "prompt_throughput": 812.3,
                "retractions": 0,
                "cache_hit_rate": 0.0,
                "engines": 1,
            },
            id="gpu-spelling",
        ),
        pytest.param(
            "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1234.5 tokens/s, Running: 29 reqs, "
            "Waiting: 47 reqs, CPU KV cache usage: 98.4%, Prefix cache hit rate: 0.0%",
            {"running": 29, "queue": 47, "token_usage": 0.984, "gen_throughput": 1234.5},
            id="cpu-spelling",
        ),
        pytest.param(
            "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2,048.0 tokens/s, Running: 128 reqs, "
            "Waiting: 3 reqs, Preemptions: 17, GPU KV cache usage: 100.0%, Prefix cache hit rate: 12.5%",
            {
                "running": 128,
                "queue": 3,
                "retractions": 17,
                "token_usage": 1.0,
                "cache_hit_rate": 0.125,
                "gen_throughput": 2048.0,
            },
            id="new-v1-preemptions",
        ),
        pytest.param(
            "Engine 001: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 4 reqs, "
            "Waiting: 5 reqs, Deferred: 2 reqs, Preemptions: 3, CPU KV cache usage: 50.0%",
            {"running": 4, "queue": 5, "retractions": 3, "token_usage": 0.5},
            id="deferred-no-prefix-cache",
        ),
        pytest.param(
            "2 Engines Aggregated: Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
            "Running: 8 reqs, Waiting: 0 reqs, GPU KV cache usage: 7.5%, Prefix cache hit rate: 1.0%",
            {"running": 8, "queue": 0, "engines": 2, "token_usage": 0.075},
            id="dp-aggregated",
        ),
    ],
)
def test_stats_line(line: str, expected: dict) -> None:
    event = parse_line(line, 12.0)
    assert event is not None and event.kind == EventKind.BATCH_STATS
    assert event.time == 12.0
    for key, value in expected.items():
        assert event.fields[key] == pytest.approx(value), key


def test_iteration_detail_line_is_not_a_stats_line() -> None:
    line = ("Engine 000: Iteration(12): 1 context requests, 100 context tokens, 3 generation requests, "
            "3 generation tokens, iteration elapsed time: 4.20 ms, GPU KV cache usage: 3.0%")  # fmt: skip
    assert parse_line(line, 0.0) is None


@pytest.mark.parametrize(
    ("line", "fields"),
    [
        pytest.param(
            "ValueError: The model's max seq len (4096) is larger than the maximum number of tokens that can be stored "
            "in KV cache (2048). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
            {"max_context": 4096, "estimated_max_context": 2048},
            id="v0",
        ),
        pytest.param(
            "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (9.50 GiB). Based on the available memory, the "
            "estimated maximum model length is 77808. Try increasing `gpu_memory_utilization` or decreasing "
            "`max_model_len` when initializing the engine.",
            {"max_context": 131072, "estimated_max_context": 77808, "needed_gib": 16.0, "available_gib": 9.5},
            id="v1-typo",
        ),
        pytest.param(
            "(EngineCore_DP0 pid=77) ValueError: To serve at least one request with the model's max seq len (8192), "
            "(0.06 GiB KV cache is needed, which is larger than the available KV cache memory (0.02 GiB). Based on the "
            "available memory, the estimated maximum model length is 2048. Try increasing `gpu_memory_utilization` "
            "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
            "engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            {"max_context": 8192, "estimated_max_context": 2048},
            id="newest",
        ),
        pytest.param(
            "ValueError: To serve at least one request with the model's max seq len (8192), (0.06 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (0.00 GiB). Try increasing `gpu_memory_utilization`",
            {"max_context": 8192},
            id="no-estimate",
        ),
        pytest.param(
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.",
            {"no_cache_blocks": True},
            id="zero-blocks",
        ),
    ],
)
def test_kv_capacity_errors(line: str, fields: dict) -> None:
    event = parse_line(line, 1.0)
    assert event is not None and event.kind == EventKind.KV_CAPACITY_ERROR
    assert dict(event.fields).items() >= fields.items()
    if "estimated_max_context" not in fields:
        assert "estimated_max_context" not in event.fields


def test_v0_preemption_warning() -> None:
    line = ("WARNING 05-09 00:49:33 scheduler.py:1057 Sequence group 0 is preempted by PreemptionMode.RECOMPUTE mode "
            "because there is not enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_cumulative_preemption_cnt=1")  # fmt: skip
    event = parse_line(line, 0.0)
    assert event is not None and event.kind == EventKind.RETRACTION
    assert event.fields == {"mode": "PreemptionMode.RECOMPUTE", "retractions_total": 1}


@pytest.mark.parametrize(
    ("line", "kind", "fields"),
    [
        ("(EngineCore_DP0 pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", EventKind.OOM, {"phase": "unknown"}),
        ("RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy requests. Please try "
         "lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.", EventKind.OOM, {"phase": "decode"}),
        ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", EventKind.CRASH, {}),
        ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
         EventKind.CRASH, {}),
        ("(EngineCore_DP0 pid=5) INFO 01-01 00:00:00 [kv_cache_utils.py:2330] GPU KV cache size: 1,048,576 tokens, "
         "Maximum concurrency for 131,072 tokens per request: 8.00x", EventKind.STARTUP,
         {"max_total_tokens": 1048576, "max_model_len": 131072, "max_concurrency": 8.0, "device": "GPU"}),
        ("INFO 01-01 00:00:00 GPU KV cache size: 8,192 tokens", EventKind.STARTUP, {"max_total_tokens": 8192}),
        ("INFO 01-01 00:00:00 Maximum concurrency for 1,024 tokens per request: 8.00x", EventKind.STARTUP,
         {"max_model_len": 1024, "max_concurrency": 8.0}),
        ("(APIServer pid=3) INFO:     Application startup complete.", EventKind.READY, {}),
    ],
)  # fmt: skip
def test_other_lines(line: str, kind: EventKind, fields: dict) -> None:
    event = parse_line(line, 0.0)
    assert event is not None and event.kind == kind
    assert dict(event.fields).items() >= fields.items()
    assert event.line == line


@pytest.mark.parametrize(
    "line",
    ["", 'INFO: 127.0.0.1:5555 - "POST /v1/completions HTTP/1.1" 200 OK', "Loading weights took 0.01 seconds"],
)
def test_unrelated_lines(line: str) -> None:
    assert parse_line(line, 0.0) is None


def _events(name: str) -> list:
    lines = (FIXTURES / name).read_text().splitlines()
    return [e for e in (parse_line(line, float(i)) for i, line in enumerate(lines)) if e is not None]


def test_recorded_serve_log() -> None:
    events = _events("vllm_0.32_cpu_serve.log")
    kinds = [e.kind for e in events]
    startup = next(e for e in events if e.kind == EventKind.STARTUP)
    assert startup.fields == {"max_total_tokens": 8192, "device": "CPU", "max_model_len": 1024, "max_concurrency": 8.0}
    assert kinds.index(EventKind.STARTUP) < kinds.index(EventKind.READY) < kinds.index(EventKind.BATCH_STATS)
    stats = next(e for e in events if e.kind == EventKind.BATCH_STATS)
    assert (stats.fields["running"], stats.fields["queue"], stats.fields["token_usage"]) == (20, 160, 1.0)
    assert not {EventKind.OOM, EventKind.CRASH, EventKind.KV_CAPACITY_ERROR} & set(kinds)


def test_recorded_kv_capacity_refusal() -> None:
    # --max-model-len 4096 with --kv-cache-memory-bytes 1048576: the cache holds fewer tokens
    events = _events("vllm_0.32_cpu_kv_capacity_error.log")
    kv = [e for e in events if e.kind == EventKind.KV_CAPACITY_ERROR]
    assert kv and all(e.fields["max_context"] == 4096 and e.fields["estimated_max_context"] == 1920 for e in kv)
    crash = [e for e in events if e.kind == EventKind.CRASH]
    assert crash and kv[0].time < crash[-1].time  # the root cause is read before the wrapper


def _oom_traceback(frames: list[str]) -> list[str]:
    head = "(EngineCore_DP0 pid=77) ERROR 01-01 00:00:00 [core.py:1510] "
    return (
        [head + "EngineCore failed to start.", head + "Traceback (most recent call last):"]
        + [
            head
            + f'  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu_model_runner.py", line {100 + i}, in {f}'
            for i, f in enumerate(frames)
        ]
        + [
            head
            + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.19 GiB"
        ]
    )


def _follow(lines: list[str]) -> list:
    follower = LogFollower()
    return [e for i, line in enumerate(lines) for e in follower.feed(line, float(i))]


def test_follower_places_a_profile_run_oom_in_prefill() -> None:
    events = _follow(_oom_traceback(["determine_available_memory", "profile_run", "_dummy_run", "forward"]))
    (oom,) = [e for e in events if e.kind == EventKind.OOM]
    assert oom.fields == {"phase": "prefill", "cause": "_dummy_run"}


def test_follower_leaves_other_ooms_unknown_and_forgets_old_tracebacks() -> None:
    first = _oom_traceback(["profile_run", "_dummy_run"])
    second = _oom_traceback(["execute_model", "forward"])
    events = _follow([*first, "INFO: Application startup complete.", *second])
    ooms = [e for e in events if e.kind == EventKind.OOM]
    assert [e.fields["phase"] for e in ooms] == ["prefill", "unknown"]


def test_weights_oom() -> None:
    line = ("ERROR 01-01 [gpu_model_runner.py:5146] Failed to load model - not enough GPU memory. Try lowering "
            "--gpu-memory-utilization to free memory for weights, increasing --tensor-parallel-size, or using --quantization.")  # fmt: skip
    event = parse_line(line, 0.0)
    assert (
        event is not None and event.kind == EventKind.OOM and event.fields == {"phase": "unknown", "cause": "weights"}
    )


# -- the versions people run: lines from the issue tracker (tests/engines/fixtures/*.txt) --------

V0_STATS = {  # id -> fields the line must give; "v1-..." ids are the V1 engine's line, the others V0's
    "0.2-llm-engine": {"prompt_throughput": 0.0, "gen_throughput": 77.3, "running": 1, "swapped": 0, "queue": 0,
                       "token_usage": 0.002, "cpu_token_usage": 0.0},
    "0.3-no-final-period": {"gen_throughput": 44.9, "running": 2, "queue": 3, "token_usage": 0.821},
    "0.5-wrapped-in-a-timestamp": {"prompt_throughput": 6501.4, "gen_throughput": 69.1, "running": 4, "queue": 0,
                                   "token_usage": 0.156},
    "0.5-idle": {"running": 0, "queue": 0, "swapped": 0, "token_usage": 0.0, "gen_throughput": 0.0},
    "0.6-collector-timestamp": {"prompt_throughput": 5.4, "gen_throughput": 4.0, "running": 2, "queue": 0},
    "0.6-final-period": {"gen_throughput": 41.7, "running": 1, "token_usage": 0.02, "cpu_token_usage": 0.0},
    "0.6-fork-full-batch": {"running": 16, "queue": 0, "token_usage": 0.921},
    "0.8-v0-cpu-swap-usage": {"gen_throughput": 15.5, "running": 1, "token_usage": 0.0, "cpu_token_usage": 0.001},
    "0.6-syslog-wrapped": {"prompt_throughput": 5902.0, "gen_throughput": 230.6, "running": 16, "queue": 11,
                           "token_usage": 0.871},
    "v1-0.8.4": {"running": 0, "queue": 0, "token_usage": 0.0, "cache_hit_rate": 0.0, "engines": 1},
    "v1-engine-head": {"prompt_throughput": 1254.4, "gen_throughput": 29.2, "running": 10, "queue": 4,
                       "token_usage": 0.579, "cache_hit_rate": 0.405},
    "v1-api-server-pid": {"gen_throughput": 1055.3, "running": 18, "queue": 43, "token_usage": 0.959},
    "v1-mm-cache-hit-rate": {"gen_throughput": 28.4, "running": 0, "queue": 0, "cache_hit_rate": 0.0},
    "v1-0.8-head-less": {"prompt_throughput": 13.0, "gen_throughput": 52.1, "running": 0, "queue": 0,
                         "cache_hit_rate": 0.8, "engines": 1},
}  # fmt: skip


@pytest.mark.parametrize("item", params("vllm_v0_lines.txt"))
def test_stats_lines_of_the_versions_in_use(item: IssueLine) -> None:
    event = parse_line(item.line, 3.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS, item.source
    assert event.time == 3.0 and event.line == item.line
    for key, value in V0_STATS[item.tags["id"]].items():
        assert event.fields[key] == pytest.approx(value), key
    if item.tags["id"].startswith("v1-"):
        assert event.fields["retractions"] == 0 and "swapped" not in event.fields
    else:  # V0 reports each preemption on a line of its own, and its queue is "Pending"
        assert "retractions" not in event.fields and event.fields["engines"] == 1


def test_every_stats_line_of_the_versions_in_use_has_expectations() -> None:
    assert {item.tags["id"] for item in issue_lines("vllm_v0_lines.txt")} == set(V0_STATS)


@pytest.mark.parametrize("item", params("vllm_v0_prefix_cache_lines.txt"))
def test_v0_prefix_cache_line_is_not_read(item: IssueLine) -> None:
    assert parse_line(item.line, 0.0) is None


@pytest.mark.parametrize("item", params("oom_lines.txt"))
def test_device_oom_wordings(item: IssueLine) -> None:
    event = parse_line(item.line, 2.0)
    assert event is not None and event.kind is EventKind.OOM, item.source
    # PyTorch's allocator and the CUDA runtime are the plain case: vLLM's events name no cause for them.
    expected_cause = "unknown" if item.tags["cause"] == "device_memory" else item.tags["cause"]
    expected_phase = "prefill" if "batch_prefill_tmp" in item.line else "unknown"
    assert event.fields == {"phase": expected_phase, "cause": expected_cause}


@pytest.mark.parametrize("item", params("oom_lines.txt"))
def test_device_oom_wordings_under_a_profile_run_are_prefill(item: IssueLine) -> None:
    frames = _oom_traceback(["determine_available_memory", "profile_run", "_dummy_run"])[:-1]
    (oom,) = [e for e in _follow([*frames, item.line]) if e.kind is EventKind.OOM]
    assert oom.fields["phase"] == "prefill"  # the frames say it when the line does not; FlashInfer's names win


def test_not_out_of_memory_cuda_errors_are_not_oom() -> None:
    # A cuBLAS failure that is not an allocation failure: the error of vllm-project/vllm#18335 as its title quotes it,
    # with the "RuntimeError: " PyTorch raises it as.
    line = "RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`"
    assert parse_line(line, 0.0) is None


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        pytest.param("vllm_nccl_startup.txt", {"phase": "unknown", "cause": "nccl"}, id="nccl-at-start-up"),
        pytest.param("vllm_sampler_warmup_decode.txt", {"phase": "decode", "cause": "sampler_warmup"}, id="sampler"),
    ],
)
def test_recorded_oom_tracebacks(name: str, fields: dict) -> None:
    events = _follow(traceback_lines(name))
    assert [e.kind for e in events] == [EventKind.OOM]
    assert events[0].fields == fields
    assert LogFollower().flush(0.0) == []


def test_flashinfer_cuda_error_names_flashinfer() -> None:
    # FlashInfer's C++ side words a failed allocation the same under any engine; this one was printed under SGLang
    # (sgl-project/sglang#109), the first line of that fixture.
    line = traceback_lines("sglang_0.1_flashinfer_decode.txt")[0]
    event = parse_line(line, 0.0)
    assert event is not None and event.kind is EventKind.OOM
    assert event.fields == {"phase": "unknown", "cause": "flashinfer_workspace"}


# The last lines of a log, in the wordings read last: the V0 stats line of a build that adds its longest
# engine step, PyTorch's driver-API check from the V1 engine core, and the caching allocator's warning.
_V0_HEAD = "INFO 05-25 06:50:29 [metrics.py:486] "
_CORE = "(EngineCore_DP0 pid=2210) ERROR 11-22 13:45:08 [core.py:710] "
_ALLOCATOR = (
    "[W1122 13:45:07.144601916 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 "
    "while trying to allocate 7516192768 bytes (free: 1547173888, total: 85029158912)."
)
_READY = "(APIServer pid=2130) INFO:     Application startup complete."
_STATS = (
    "(APIServer pid=2130) INFO 11-22 13:45:01 [loggers.py:236] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 812.4 tokens/s, Running: 64 reqs, Waiting: 3 reqs, GPU KV cache usage: 91.0%, "
    "Prefix cache hit rate: 2.0%"
)
_DEAD = (
    "(APIServer pid=2130) ERROR 11-22 13:45:09 [async_llm.py:480] AsyncLLM output_handler failed. "
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."
)


@pytest.mark.parametrize(
    ("line", "step_s"),
    [
        pytest.param(
            "Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.5 tokens/s, Running: 12 reqs, "
            "Swapped: 1 reqs, Pending: 7 reqs, GPU KV cache usage: 97.2%, CPU KV cache usage: 3.5%, "
            "Max iteration time: 187.3 ms.",
            0.1873,
            id="at-the-end",
        ),
        pytest.param(
            "Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.5 tokens/s, Max iteration time: 0.19 s, "
            "Running: 12 reqs, Swapped: 1 reqs, Pending: 7 reqs, GPU KV cache usage: 97.2%, CPU KV cache usage: 3.5%.",
            0.19,
            id="after-the-throughputs",
        ),
    ],
)
def test_v0_stats_line_with_its_longest_step(line: str, step_s: float) -> None:
    event = parse_line(_V0_HEAD + line, 3.0)
    assert event is not None and event.kind is EventKind.BATCH_STATS
    assert {k: event.fields[k] for k in ("running", "queue", "swapped")} == {"running": 12, "queue": 7, "swapped": 1}
    assert event.fields["token_usage"] == pytest.approx(0.972) and event.fields["cpu_token_usage"] == pytest.approx(
        0.035
    )
    assert event.fields["max_iteration_s"] == pytest.approx(step_s)


def test_the_engine_cores_driver_out_of_memory_is_an_oom_placed_by_its_frames() -> None:
    line = _CORE + "RuntimeError: CUDA driver error: out of memory"
    event = parse_line(line, 0.0)
    assert (
        event is not None and event.kind is EventKind.OOM and event.fields == {"phase": "unknown", "cause": "unknown"}
    )
    frames = _oom_traceback(["determine_available_memory", "profile_run", "_dummy_run"])[:-1]
    (oom,) = [e for e in _follow([*frames, line]) if e.kind is EventKind.OOM]
    assert oom.fields["phase"] == "prefill"
    assert classify_death([_READY, _STATS, line, _DEAD]).cause == "oom"


def test_the_allocators_failed_first_try_is_no_event_but_explains_a_death_nothing_else_does() -> None:
    assert parse_line(_ALLOCATOR, 0.0) is None  # it frees its cache and tries again: no OOM yet
    assert [e.kind for e in _follow([_READY, _STATS, _ALLOCATOR, _STATS])] == [EventKind.READY] + [
        EventKind.BATCH_STATS
    ] * 2
    # the engine core died after it with no word of its own: the API server's crash line, or nothing at all
    for tail in ([_READY, _STATS, _ALLOCATOR, _DEAD], [_READY, _STATS, _ALLOCATOR, _STATS]):
        death = classify_death(tail)
        assert (death.cause, death.detail, death.started) == ("oom", _ALLOCATOR, True)
    # an OutOfMemoryError after it says more; a warning before a restart says nothing of the next run's end
    torch_oom = _CORE + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB."
    assert classify_death([_READY, _ALLOCATOR, torch_oom, _DEAD]).detail == torch_oom
    assert classify_death([_ALLOCATOR, _READY, _STATS]).cause == "unknown"
