"""A worker's error answers in OpenAI's shape: every engine spelling, the status kept."""

from __future__ import annotations

import orjson
import pytest

from proxy.errors import openai_error_body, reshape_error_events


@pytest.mark.parametrize(
    "status, body, message, kind",
    [
        (400, b'{"object": "error", "message": "too long", "type": "BadRequestError", "param": null, "code": 400}',
         "too long", "invalid_request_error"),
        (400, b'{"error": {"message": "n too large"}}', "n too large", "invalid_request_error"),
        (401, b'{"error": "Unauthorized"}', "Unauthorized", "authentication_error"),
        (422, b'{"detail": [{"loc": ["body"], "msg": "field required"}]}', "field required", "invalid_request_error"),
        (503, b"engine overloaded", "engine overloaded", "server_error"),
        (429, b'{"error": {"message": "slow down", "type": "rate_limit_error", "param": "x", "code": "busy"}}',
         "slow down", "rate_limit_error"),
        (500, b"", "the worker answered HTTP 500", "server_error"),
    ],
)  # fmt: skip
def test_every_spelling_becomes_openais_shape(status, body, message, kind):
    out = orjson.loads(openai_error_body(status, body))
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    assert message in out["error"]["message"] and out["error"]["type"] == kind


def test_stream_error_events_are_rewritten_and_nothing_else():
    ok = b'data: {"choices": [{"text": "{\\"error\\": 1}"}]}\n\n'
    assert reshape_error_events(ok) == ok
    err = b'data: {"error": {"object": "error", "message": "boom", "code": 503}}\n\n'
    partial = b'data: {"error": {"mess'
    out = reshape_error_events(ok + err + partial)
    first, second, rest = out.split(b"\n\n")
    assert first + b"\n\n" == ok and rest == partial
    assert orjson.loads(second[6:]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
