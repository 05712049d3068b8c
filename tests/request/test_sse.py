"""A relayed stream starts at its first content: the opening role event alone is not output."""

from __future__ import annotations

import pytest

from proxy.request.sse import has_output

ROLE = b'data: {"id":"1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
CONTENT = b'data: {"id":"1","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'


@pytest.mark.parametrize(
    ("data", "started"),
    [
        pytest.param(b"", False, id="nothing"),
        pytest.param(ROLE, False, id="role-only"),
        pytest.param(ROLE + ROLE.replace(b'"content":""', b'"content":null'), False, id="role-twice"),
        pytest.param(ROLE + CONTENT[:30], False, id="role-then-content-in-the-making"),
        pytest.param(ROLE + CONTENT, True, id="role-then-content"),
        pytest.param(CONTENT, True, id="content"),
        pytest.param(b'data: {"text":"x","meta_info":{}}\n\n', True, id="generate"),
        pytest.param(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'[:10], True, id="completion-first-bytes"),
        pytest.param(ROLE.replace(b'"content":""', b'"content":"Hi"'), True, id="role-with-content"),
        pytest.param(ROLE.replace(b'"finish_reason":null', b'"finish_reason":"length"'), True, id="role-and-finish"),
        pytest.param(ROLE + b"data: [DONE]\n\n", True, id="role-then-done"),
        pytest.param(b'data: {"error":{"message":"no","role":"x"}}\n\n', True, id="error-event"),
    ],
)
def test_has_output(data: bytes, started: bool) -> None:
    assert has_output(data) is started
