"""Batch input files: OpenAI's limits and the check of every JSONL request line.

A line is ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {"model": ...}}``.
A bad line (not JSON, no or a duplicate ``custom_id``, another url, another model, ``stream``) becomes a
:class:`BadLine`; as at OpenAI, a file with any bad line fails the batch at validation and nothing of
it runs, the batch's ``errors`` naming each line (:func:`line_problems`; a batch that ran some lines
and set others aside would leave the client to join two files, and a duplicate ``custom_id`` could
not be joined at all). A file that is not a request file at all is refused as one
(:class:`FileRefused`): empty, over the limits, or with no line that parses as a JSON object (the
error names the first such line). Line numbers count from 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

MAX_REQUESTS = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINE_ERRORS = 100  # a failed validation lists at most this many lines, then says how many more


@dataclass(frozen=True, slots=True)
class RequestLine:
    line: int
    custom_id: str
    model: str
    body: bytes  # the request body as JSON


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ValidatedFile:
    requests: tuple[RequestLine, ...]
    bad: tuple[BadLine, ...]
    model: str | None  # the model every request line names


class FileRefused(Exception):
    """The whole file is not a batch input: the batch fails validation with this error."""

    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.line = line


def _check(
    n: int, item: Any, endpoint: str, model: str | None, seen: set[str], accepts_model: Callable[[str], bool]
) -> RequestLine | BadLine:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(n, None, "missing_custom_id", f"line {n}: 'custom_id' must be a non-empty string")
    if custom_id in seen:
        return BadLine(
            n,
            custom_id,
            "duplicate_custom_id",
            f"line {n}: custom_id {custom_id!r} is used by an earlier line; custom_id must be unique",
        )
    seen.add(custom_id)

    def bad(code: str, message: str) -> BadLine:
        return BadLine(n, custom_id, code, f"line {n}: {message}")

    if item.get("method", "POST") != "POST":
        return bad("invalid_method", f"method must be 'POST', got {item.get('method')!r}")
    if item.get("url") != endpoint:
        return bad("mismatched_url", f"url {item.get('url')!r} differs from the batch's endpoint {endpoint!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "'body' must be a JSON object")
    line_model = body.get("model")
    if not isinstance(line_model, str) or not line_model:
        return bad("missing_model", "'body.model' must be a non-empty string")
    if not accepts_model(line_model):
        return bad("model_not_found", f"the model {line_model!r} is not served here")
    if model is not None and line_model != model:
        return bad(
            "mismatched_model",
            f"model {line_model!r} differs from the batch's model {model!r}; "
            "every line of a batch must name the same model",
        )
    if body.get("stream"):
        return bad("invalid_value", "'body.stream' is not supported in a batch")
    return RequestLine(n, custom_id, line_model, orjson.dumps(body))


def validate_lines(
    lines: Iterable[bytes], *, endpoint: str, accepts_model: Callable[[str], bool] = lambda _model: True
) -> ValidatedFile:
    """Sort the lines of an input file into requests and bad lines; blank lines are skipped."""
    requests: list[RequestLine] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    model: str | None = None
    first_unparsed: int | None = None
    parsed_any = False
    count = 0
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_REQUESTS:
            raise FileRefused("too_many_requests", f"the file has more than {MAX_REQUESTS} requests", n)
        try:
            item = orjson.loads(raw.rstrip())
        except orjson.JSONDecodeError as exc:  # its own line and column count within this line
            item, reason = None, f"invalid JSON at character {exc.pos + 1}: {exc.msg}"
        else:
            reason = "a request line must be a JSON object"
        if not isinstance(item, dict):
            first_unparsed = first_unparsed or n
            bad.append(BadLine(n, None, "invalid_json_line", f"line {n}: {reason}"))
            continue
        parsed_any = True
        checked = _check(n, item, endpoint, model, seen, accepts_model)
        if isinstance(checked, RequestLine):
            model = model or checked.model
            requests.append(checked)
        else:
            bad.append(checked)
    if count == 0:
        raise FileRefused("empty_file", "the file has no request lines")
    if not parsed_any:
        raise FileRefused(
            "invalid_json_line", f"the file is not JSONL: line {first_unparsed} is not a JSON object", first_unparsed
        )
    return ValidatedFile(tuple(requests), tuple(bad), model)


def line_problems(bad: Sequence[BadLine]) -> list[tuple[str, str, int | None]]:
    """A failed validation's ``errors`` (code, message, line), the first :data:`MAX_LINE_ERRORS` lines
    and, past them, one entry saying how many more."""
    problems: list[tuple[str, str, int | None]] = [(b.code, b.message, b.line) for b in bad[:MAX_LINE_ERRORS]]
    if len(bad) > MAX_LINE_ERRORS:
        more = len(bad) - MAX_LINE_ERRORS
        problems.append(
            (
                "too_many_errors",
                f"{more} more lines are not valid requests (the first {MAX_LINE_ERRORS} are listed)",
                None,
            )
        )
    return problems
