"""One event stream from the parts of an answer sent under an output budget (a pure state machine).

A streamed request that goes to its worker under the output budget (:mod:`proxy.request.continuation`)
may come back in parts: each part is a stream of its own, and the client must see one. The relay
feeds :class:`StreamStitcher` each part's bytes as they arrive and writes what it gives back, so
the text reaches the client as it is written, part after part:

* every content event goes on at once; a later part's carry the first part's ``id`` and
  ``created``, and a later chat part's opening role event is dropped (the client has had one);
* a part's finish event, its usage event and ``data: [DONE]`` are held back until the part ends:
  then the relay knows whether the answer goes on (the part stopped at its cap, by "length", before
  the client's ``max_tokens``). If it does they are dropped; if not, :meth:`StreamStitcher.finish`
  gives the last finish event, the usage of the whole answer (the first part's prompt tokens, every
  part's completion tokens) when the client asked for it, and ``data: [DONE]``;
* the text so far is kept, to continue from; a part whose worker broke mid-way
  (:meth:`StreamStitcher.end_broken`) counts a token for each event that carried text, and the next
  part, on another worker, goes on from there.

An event that carries content and the finish reason at once goes on as content, its finish held
back on its own. Events it cannot read (an error event, a comment) go on as they came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.request.continuation import CHAT

__all__ = ["PartEnd", "StreamStitcher", "WholeEvents"]

_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class PartEnd:
    """How one part of a stream ended."""

    reason: str | None  # its finish reason (None: it ended without one)
    part_written: int | None  # its completion tokens, from its usage event (None: it sent none)
    written: int  # the answer's completion tokens so far (every part that said)
    pieces: tuple[str | bytes, ...]  # the answer's text so far, content events not yet read as bytes
    chat: bool

    @property
    def text(self) -> str:
        """The answer's text so far (read only where an answer goes on: most never need it)."""
        return "".join(p if isinstance(p, str) else _text_of(p, self.chat) for p in self.pieces)


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    """The text one event's first choice carries: a chat delta's content, a completion's text ('' if none)."""
    delta = choice.get("delta") if chat else None
    text = (delta.get("content") if isinstance(delta, dict) else None) if chat else choice.get("text")
    return text if isinstance(text, str) else ""


def _text_of(body: bytes, chat: bool) -> str:
    """The text one content event's JSON ``body`` carries ('' where it carries none)."""
    return _choice_text(orjson.loads(body)["choices"][0], chat)


# An event of the first part that is plain content as the engines write it (not its finish, no usage):
# it goes on as it came, and its text is read only if the answer goes on (:attr:`PartEnd.text`).
_NOT_FINISHED = (b'"finish_reason":null', b'"finish_reason": null')
_NO_USAGE = (b'"usage":null', b'"usage": null')


def _plain_content(body: bytes) -> bool:
    return (_NOT_FINISHED[0] in body or _NOT_FINISHED[1] in body) and (
        b'"usage"' not in body or _NO_USAGE[0] in body or _NO_USAGE[1] in body
    )


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class WholeEvents:
    """A stream's bytes cut at its last event boundary: a worker's event may arrive in two reads (a
    remote worker, a segment boundary), and what the relay rewrites (the usage event it asked for,
    an error event) is recognised only whole. The client's parser waits for a whole event anyway, so
    holding back its first half costs no time. Free when reads end on a boundary, as they mostly do.
    A boundary is a blank line, ``\n\n`` or ``\r\n\r\n``; more than :attr:`HELD_MAX` bytes with
    none goes on as it is (no usage or error event is that long)."""

    HELD_MAX = 4 << 20
    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> bytes:
        """The whole events up to the last boundary in what arrived (and what was held back)."""
        if not self._rest and data.endswith(b"\n\n"):
            return data
        data = self._rest + data
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if not end and len(data) > self.HELD_MAX:
            end = len(data)
        self._rest = data[end:]
        return data[:end]

    def rest(self) -> bytes:
        """What came after the last boundary (a stream that ended without one)."""
        rest, self._rest = self._rest, b""
        return rest


class StreamStitcher:
    """See the module docstring; ``client_usage``: the client asked for the usage event."""

    __slots__ = (
        "_chat",
        "_first",
        "_held_finish",
        "_in_part",
        "_part_events",
        "_part_start",
        "_part_written",
        "_parts",
        "_prompt",
        "_reason",
        "_text",
        "_whole",
        "_written",
        "client_usage",
    )

    def __init__(self, path: str, *, client_usage: bool) -> None:
        self._chat = path == CHAT
        self.client_usage = client_usage  # the client asked for the usage event
        self._first: dict[str, Any] = {}  # the first part's id, object, created, model
        self._text: list[str | bytes] = []  # text read, or a content event's body not yet read
        self._written = 0
        self._prompt: int | None = None
        self._parts = 0
        self._whole = WholeEvents()
        self._held_finish: dict[str, Any] | None = None
        self._reason: str | None = None
        self._part_written: int | None = None
        self._part_events = 0  # the part's events that carried text (those read)
        self._part_start = 0  # where the part's pieces begin in ``_text``
        self._in_part = False  # a part began and has not ended

    def begin_part(self) -> None:
        """A part's stream starts (the first one too)."""
        self._parts += 1
        self._whole = WholeEvents()  # what a part left unfinished of an event is dropped
        self._held_finish = None
        self._reason = None
        self._part_written = None
        self._part_events = 0
        self._part_start = len(self._text)
        self._in_part = True

    def feed(self, data: bytes) -> bytes:
        """The bytes of the part that arrived; what the client gets now."""
        events = self._whole.feed(data).split(b"\n\n")
        return b"".join(self._one(event) for event in events if event.strip())

    def end_part(self) -> PartEnd:
        """The part's stream ended: how (what is left unfinished of an event is dropped)."""
        if self._part_written is not None and self._in_part:
            self._written += self._part_written
        self._in_part = False
        return PartEnd(self._reason, self._part_written, self._written, tuple(self._text), self._chat)

    @property
    def ended(self) -> bool:
        """The part sent its finish event (its finish reason is known)."""
        return self._reason is not None

    def end_broken(self) -> PartEnd:
        """The part's stream broke (its worker died): it wrote the text that reached the stitcher, and
        as many tokens as the events that carried it (what an engine streams by default: one token an
        event), since no usage event came. Its finish reason, if its finish event came before the break."""
        if self._part_written is None and self._in_part:
            unread = [p for p in self._text[self._part_start :] if isinstance(p, bytes)]
            self._part_written = self._part_events + sum(1 for p in unread if _text_of(p, self._chat))
        return self.end_part()

    def finish(self) -> tuple[bytes, bytes]:
        """The answer's end: (what the client gets, the same with the usage event whatever the client
        asked: what the relay's facts read)."""
        finish = _event(self._held_finish) if self._held_finish is not None else b""
        usage = b""
        if self._prompt is not None:
            usage = _event({**self._first, "choices": [], "usage": {
                "prompt_tokens": self._prompt, "completion_tokens": self._written,
                "total_tokens": self._prompt + self._written}})  # fmt: skip
        return finish + (usage if self.client_usage else b"") + _DONE, finish + usage + _DONE

    def _one(self, event: bytes) -> bytes:
        line = event.strip()
        if not line.startswith(b"data:"):
            return event + b"\n\n"
        body = line[5:].strip()
        if body == b"[DONE]":
            return b""  # once, at the very end
        if self._parts == 1 and self._first and _plain_content(body):
            self._text.append(body)
            return event + b"\n\n"
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(payload, dict) or "error" in payload:
            return event + b"\n\n"
        usage = payload.get("usage")
        if isinstance(usage, dict):
            prompt, written = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if self._parts == 1 and isinstance(prompt, int):
                self._prompt = prompt
            elif self._prompt is None and isinstance(prompt, int):  # the first part broke before its usage:
                self._prompt = max(0, prompt - self._written)  # a later part's prompt is it and the text so far
            if isinstance(written, int):
                self._part_written = written
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return b""  # a usage event: the whole answer's goes at the end
        if self._parts == 1:
            if not self._first:
                self._first = {k: payload[k] for k in ("id", "object", "created", "model") if k in payload}
        else:
            payload.update(self._first)
        payload.pop("usage", None)
        choice = dict(choices[0])
        delta = choice.get("delta") if self._chat else None
        text = _choice_text(choice, self._chat)
        if text:
            self._text.append(text)
            self._part_events += 1
        reason = choice.get("finish_reason")
        if reason is None:
            if self._parts > 1 and self._chat and isinstance(delta, dict) and not text and "role" in delta:
                return b""  # a later part's opening role event: the client has had one
            return _event(payload) if self._parts > 1 else event + b"\n\n"
        self._reason = reason if isinstance(reason, str) else None
        self._held_finish = {**payload, "choices": [{**choice, **({"delta": {}} if self._chat else {"text": ""})}]}
        if not text:
            return b""
        return _event({**payload, "choices": [{**choice, "finish_reason": None}]})  # its content goes on
