"""OpenAI's wire shapes for the Batch API: the File and Batch objects, list pages, result lines.

The ``openai`` client parses every one of them (``FileObject``, ``Batch``, ``SyncCursorPage``). A result
line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {"code",
"message"} | null}``: a 2xx answer goes to the output file, any other answer (with its ``response``) and
every line that never got one (with its ``error``) to the error file.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

Json = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def file_object(*, id: str, bytes: int, created_at: int, filename: str, purpose: str) -> Json:
    return {
        "id": id,
        "object": "file",
        "bytes": bytes,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def page(data: Sequence[Json], *, has_more: bool) -> Json:
    return {
        "object": "list",
        "data": list(data),
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def parse_answer(body: bytes) -> Any:
    """A worker's answer as JSON, or as text where it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


def output_line(custom_id: str, *, status_code: int, request_id: str, answer: Any) -> bytes:
    """A result line around ``answer`` (:func:`parse_answer`)."""
    return orjson.dumps(
        {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": answer},
            "error": None,
        }
    )


@dataclass(frozen=True, slots=True)
class Usage:
    """What one answer says it used (its ``usage``: prompt tokens, of which cached, and completion
    tokens, of which reasoning)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0  # of the output, a reasoning model's


NO_USAGE = Usage()


def usage_of(answer: Any) -> Usage:
    """The ``usage`` of a chat or completions answer (:func:`parse_answer`); nothing where it has
    none (an error's body)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return NO_USAGE

    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    prompt, completion = usage.get("prompt_tokens_details"), usage.get("completion_tokens_details")
    return Usage(
        input_tokens=count(usage.get("prompt_tokens")),
        cached_tokens=count(prompt.get("cached_tokens")) if isinstance(prompt, dict) else 0,
        output_tokens=count(usage.get("completion_tokens")),
        reasoning_tokens=count(completion.get("reasoning_tokens")) if isinstance(completion, dict) else 0,
    )


def error_line(custom_id: str | None, *, code: str, message: str) -> bytes:
    return orjson.dumps(
        {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


EXPIRED = ("batch_expired", "This request could not be executed before the completion window expired.")
CANCELLED = ("batch_cancelled", "This request was not executed because the batch was cancelled.")
