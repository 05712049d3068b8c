"""When a relayed event stream has started: at its first content, not at its first bytes.

An OpenAI chat stream opens with an event that only names the role
(``data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}``); a worker may send it
before it has generated anything (the simulator sends it on arrival). Until content follows, the
client has nothing worth keeping, so the relay holds those opening events back and the attempt can
still be retried or taken back. This is the front door's protocol (the OpenAI SSE chunk shape),
not an engine's.

Cheap on the hot path: only bytes that contain ``"role"`` are parsed (a chat stream's first
chunk); completions, ``/generate`` and every later chunk are not looked at.
"""

from __future__ import annotations

import orjson

__all__ = ["has_output"]


def has_output(data: bytes) -> bool:
    """True when ``data``, the start of an event stream, holds more than its opening role events.

    Bytes after the complete events are an event in the making: they count as output only once
    it is complete (a stream that carries no ``"role"`` at all starts at its first byte).
    """
    if b'"role"' not in data:
        return bool(data)
    *events, _partial = data.split(b"\n\n")
    return any(not _opening(event) for event in events if event.strip())


def _opening(event: bytes) -> bool:
    """An event whose every choice only announces the role (nothing else, no finish reason)."""
    line = event.strip()
    if not line.startswith(b"data:") or b"\n" in line:
        return False
    try:
        payload = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return False
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta or choice.get("finish_reason") is not None:
            return False
        if any(value not in (None, "", []) for key, value in delta.items() if key != "role"):
            return False
    return True
