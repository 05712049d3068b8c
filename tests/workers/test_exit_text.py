"""Why a worker ended, in the operator's words, on recorded output: the error line, not the usage
before it; the end of a long text, not its start; one run's lines, not the runs before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.workers.exit_text import CUT_MARK, describe_exit, error_lines, keep_end, shorten_cause
from proxy.workers.process import LineLog

FIXTURES = Path(__file__).with_name("fixtures")
ENGINE_FIXTURES = Path(__file__).parent.parent / "engines" / "fixtures"

# `pacer sim --no-such-flag` (an unknown flag in the policy's extra_args): 37 lines of usage, then the error
BAD_FLAG = (FIXTURES / "sim_unrecognized_argument.log").read_text().splitlines()
# kind = "sglang" where SGLang is not installed: `python3 -m sglang.launch_server`, all it prints
NO_SGLANG = [
    "PYTHON/bin/python3: Error while finding module specification for 'sglang.launch_server' "
    "(ModuleNotFoundError: No module named 'sglang')"
]


def test_an_unknown_flag_is_told_by_argparse_s_error_line_not_its_usage() -> None:
    assert len(BAD_FLAG) > 30 and BAD_FLAG[0].startswith("usage: pacer sim")
    assert describe_exit(2, BAD_FLAG) == "exited with code 2: pacer sim: error: unrecognized arguments: --no-such-flag"


def test_a_missing_engine_module_is_told_by_python_s_line() -> None:
    assert describe_exit(1, NO_SGLANG) == f"exited with code 1: {NO_SGLANG[0]}"


def test_a_traceback_is_told_by_its_exceptions_last_lines() -> None:
    """vLLM refusing a start-up for KV capacity: the root cause and the API server's own error, not the
    resource tracker's warning printed after them."""
    lines = (ENGINE_FIXTURES / "vllm_0.32_cpu_kv_capacity_error.log").read_text().splitlines()
    said = describe_exit(1, lines)
    first, last = said.removeprefix("exited with code 1: ").split(" | ")
    assert first.startswith("ValueError: To serve at least one request with the model's max seq len (4096)")
    assert last == "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    assert "resource_tracker" not in said


def test_a_sglang_scheduler_crash_names_its_exception() -> None:
    lines = (ENGINE_FIXTURES / "sglang_crash_decode_cuda_oom.log").read_text().splitlines()
    assert error_lines(lines)[-1].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB")


def test_without_an_error_line_the_last_lines_are_quoted_and_a_signal_is_named() -> None:
    lines = ["loading weights", "", "  Decode batch, #running-req: 4", "   "]
    assert describe_exit(-9, lines) == "killed by SIGKILL: loading weights | Decode batch, #running-req: 4"
    assert describe_exit(0, []) == "exited with code 0"


def test_a_long_quote_is_cut_at_its_front_and_says_so() -> None:
    lines = [f"line {i} " + "x" * 100 for i in range(20)]
    said = describe_exit(3, lines, limit=300)
    assert len(said) == 300
    assert said.startswith(f"exited with code 3: {CUT_MARK}") and said.endswith("line 19 " + "x" * 100)


@pytest.mark.parametrize(
    ("text", "limit", "kept"),
    [
        ("short", 10, "short"),
        ("0123456789", 10, "0123456789"),
        ("0123456789abc", 10, CUT_MARK + "456789abc"),
        ("0123456789", 1, "9"),
        ("0123456789", 0, ""),
    ],
)
def test_keep_end(text: str, limit: int, kept: str) -> None:
    assert keep_end(text, limit) == kept


def test_a_cause_shortened_again_keeps_how_it_ended() -> None:
    """The journal keeps a death's cause in fewer characters than the pool's: a kill -9 under load
    quotes long decode lines, and the signal must survive the cut."""
    lines = [f"[2026-11-28 12:30:0{i}] Decode batch, #running-req: 4, #token: 90, " + "x" * 100 for i in range(8)]
    cause = describe_exit(-9, lines)
    short = shorten_cause(cause, 300)
    assert len(short) == 300 and short.startswith(f"killed by SIGKILL: {CUT_MARK}") and short.endswith("x" * 100)
    assert shorten_cause(cause, len(cause)) == cause
    assert shorten_cause("no head at all " * 10, 20) == keep_end("no head at all " * 10, 20)
    assert shorten_cause("a very long head of a cause: then more", 12) == keep_end(
        "a very long head of a cause: then more", 12
    )


def test_a_run_s_tail_holds_only_the_lines_since_its_launch() -> None:
    lines = LineLog(maxlen=5)
    assert lines.run_tail(10) == []
    for line in ("first run starts", "first run: error: bad"):
        lines.push(line)
    lines.begin_run()
    assert lines.run_tail(10) == [] and lines.tail(10) == ["first run starts", "first run: error: bad"]
    lines.push("second run starts")
    assert lines.run_tail(10) == ["second run starts"]
    for i in range(6):  # past the ring's size: what it still holds of this run
        lines.push(f"second run line {i}")
    assert lines.run_tail(10) == [f"second run line {i}" for i in range(1, 6)]
    assert lines.run_tail(2) == ["second run line 4", "second run line 5"]


def test_an_error_logged_long_before_the_end_is_not_why_it_ended() -> None:
    refused = ["ValueError: prompt too long (a request refused, the engine went on)"]
    healthy = [f"[2026-11-28 12:00:{i:02d}] Decode batch. #running-req: 3" for i in range(120)]
    assert describe_exit(1, refused + healthy + ["AssertionError"]) == "exited with code 1: AssertionError"
    assert describe_exit(-9, refused + healthy[:5]) == "killed by SIGKILL: " + " | ".join(
        (refused + healthy[:5])[-8:]
    )  # a signal: what it was doing, not an error line of its past
