from __future__ import annotations

import pytest

from proxy.batch.jsonl import MAX_LINE_ERRORS, MAX_REQUESTS, FileRefused, ValidatedFile, line_problems, validate_lines
from tests.batch.conftest import CHAT, request_line


def check(*lines: bytes) -> ValidatedFile:
    return validate_lines(lines, endpoint=CHAT, accepts_model=lambda m: m in ("m", "other"))


def test_good_lines_keep_their_line_numbers_and_the_model() -> None:
    out = check(request_line("a"), b"", request_line("b"))
    assert [(r.line, r.custom_id) for r in out.requests] == [(1, "a"), (3, "b")]
    assert out.bad == () and out.model == "m"


@pytest.mark.parametrize(
    ("line", "code"),
    [
        pytest.param(b"{not json", "invalid_json_line", id="invalid-json"),
        pytest.param(b"[1, 2]", "invalid_json_line", id="not-an-object"),
        pytest.param(
            b'{"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}',
            "missing_custom_id",
            id="no-custom-id",
        ),
        pytest.param(request_line("a"), "duplicate_custom_id", id="duplicate"),
        pytest.param(request_line("x", url="/v1/completions"), "mismatched_url", id="wrong-url"),
        pytest.param(request_line("x", model="other"), "mismatched_model", id="another-model"),
        pytest.param(request_line("x", model="unknown"), "model_not_found", id="unserved-model"),
        pytest.param(request_line("x", stream=True), "invalid_value", id="stream"),
        pytest.param(
            b'{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}',
            "invalid_method",
            id="method",
        ),
        pytest.param(b'{"custom_id": "x", "url": "/v1/chat/completions", "body": {}}', "missing_model", id="no-model"),
    ],
)
def test_a_bad_line_is_named_with_its_code_and_line(line: bytes, code: str) -> None:
    out = check(request_line("a"), line, request_line("b"))
    assert [r.custom_id for r in out.requests] == ["a", "b"]
    assert [(b.line, b.code) for b in out.bad] == [(2, code)]
    assert out.bad[0].message.startswith("line 2: ")


def test_a_file_that_is_not_jsonl_is_refused_with_the_line_number() -> None:
    with pytest.raises(FileRefused) as refused:
        check(b"", b"custom_id,url,body", b"a,b,c")
    assert refused.value.code == "invalid_json_line"
    assert refused.value.line == 2
    assert "line 2" in refused.value.message


def test_an_empty_file_is_refused() -> None:
    with pytest.raises(FileRefused, match="no request lines"):
        check(b"", b"  ")


def test_more_requests_than_openai_allows_are_refused() -> None:
    line = request_line("x")
    assert len(check(*([line] * MAX_REQUESTS)).bad) == MAX_REQUESTS - 1  # duplicates, but within the limit
    with pytest.raises(FileRefused) as refused:
        check(*([line] * (MAX_REQUESTS + 1)))
    assert refused.value.code == "too_many_requests"
    assert refused.value.line == MAX_REQUESTS + 1


def test_invalid_json_is_placed_within_its_own_line() -> None:
    [bad] = check(request_line("a"), b'{"custom_id": "x", "body": \n').bad
    assert bad.message == "line 2: invalid JSON at character 27: unexpected end of data"


def test_a_failed_validation_lists_the_first_lines_and_counts_the_rest() -> None:
    bad = check(*([request_line("a")] * (MAX_LINE_ERRORS + 8))).bad
    problems = line_problems(bad)
    assert len(problems) == MAX_LINE_ERRORS + 1
    assert problems[0] == ("duplicate_custom_id", bad[0].message, 2)
    assert problems[-1][0] == "too_many_errors" and "7 more lines" in problems[-1][1]
    assert line_problems(bad[:3]) == [(b.code, b.message, b.line) for b in bad[:3]]
