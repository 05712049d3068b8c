"""The stream stitcher on hand-built parts: one stream for the client, whatever the parts."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.request.continuation import CHAT, COMPLETIONS
from proxy.request.parts import SentEvents
from proxy.request.stitch import StreamStitcher, WholeEvents


def _ev(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(id_: str, delta: dict[str, Any] | None = None, reason: str | None = None, text: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    choice.update({"delta": delta or {}} if text is None else {"text": text})
    return _ev({"id": id_, "object": "chat.completion.chunk", "created": 7 if id_ == "a" else 9, "model": "m",
                "choices": [choice]})  # fmt: skip


def _usage(id_: str, prompt: int, written: int) -> bytes:
    return _ev({"id": id_, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": written}})


def _events(data: bytes) -> list[Any]:
    out = []
    for event in data.split(b"\n\n"):
        line = event.strip()
        if line:
            assert line.startswith(b"data: ")
            out.append("[DONE]" if line == b"data: [DONE]" else orjson.loads(line[6:]))
    return out


def test_two_chat_parts_are_one_stream_with_the_whole_usage() -> None:
    s = StreamStitcher(CHAT, client_usage=True)
    s.begin_part()
    first = (_chunk("a", {"role": "assistant", "content": ""}) + _chunk("a", {"content": "one"})
             + _chunk("a", {"content": " two"}) + _chunk("a", {}, "length") + _usage("a", 9, 2) + b"data: [DONE]\n\n")  # fmt: skip
    sent = s.feed(first[:50]) + s.feed(first[50:])  # an event split across two reads
    assert [e["choices"][0]["delta"] for e in _events(sent)] == [{"role": "assistant", "content": ""},
                                                                  {"content": "one"}, {"content": " two"}]  # fmt: skip
    end = s.end_part()
    assert (end.reason, end.part_written, end.written, end.text) == ("length", 2, 2, "one two")
    s.begin_part()
    second = (_chunk("b", {"role": "assistant", "content": ""}) + _chunk("b", {"content": " three"})
              + _chunk("b", {}, "stop") + _usage("b", 11, 1) + b"data: [DONE]\n\n")  # fmt: skip
    more = _events(s.feed(second))
    assert more == [{"id": "a", "object": "chat.completion.chunk", "created": 7, "model": "m",
                     "choices": [{"index": 0, "finish_reason": None, "delta": {"content": " three"}}]}]  # fmt: skip
    end = s.end_part()
    assert (end.reason, end.written, end.text) == ("stop", 3, "one two three")
    client, tail = s.finish()
    finish, usage, done = _events(client)
    assert finish["id"] == "a" and finish["choices"][0]["finish_reason"] == "stop" and done == "[DONE]"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert tail == client


def test_the_usage_goes_to_the_facts_only_when_the_client_did_not_ask() -> None:
    s = StreamStitcher(COMPLETIONS, client_usage=False)
    s.begin_part()
    out = s.feed(_chunk("a", text="x y", reason="stop") + _usage("a", 4, 2) + b"data: [DONE]\n\n")
    # the content of an event that also finishes goes on at once, its finish waits for the part's end
    assert [e["choices"][0] for e in _events(out)] == [{"index": 0, "finish_reason": None, "text": "x y"}]
    assert s.end_part().reason == "stop"
    client, tail = s.finish()
    assert [e if e == "[DONE]" else e["choices"] for e in _events(client)] == [
        [{"index": 0, "finish_reason": "stop", "text": ""}], "[DONE]"]  # fmt: skip
    assert _events(tail)[1]["usage"]["completion_tokens"] == 2


def test_what_it_cannot_read_goes_on_as_it_came() -> None:
    s = StreamStitcher(CHAT, client_usage=False)
    s.begin_part()
    error = _ev({"error": {"message": "boom", "code": 500}})
    assert s.feed(b": keep-alive\n\n" + error) == b": keep-alive\n\n" + error
    assert s.end_part().reason is None and s.end_part().part_written is None


def test_whole_events_holds_back_an_events_first_half_until_its_boundary() -> None:
    whole = WholeEvents()
    assert whole.feed(b"data: 1\n\n") == b"data: 1\n\n"  # a read on a boundary goes on as it came
    assert whole.feed(b'data: 2\n\ndata: {"us') == b"data: 2\n\n"
    assert whole.feed(b'age": 1}') == b""  # still no boundary
    assert whole.feed(b"\n") == b""
    assert whole.feed(b"\ndata: [DONE]\n\n") == b'data: {"usage": 1}\n\ndata: [DONE]\n\n'
    assert whole.feed(b"data: tail") == b"" and whole.rest() == b"data: tail" and whole.rest() == b""


def test_whole_events_knows_crlf_boundaries_and_lets_an_endless_event_go_on() -> None:
    whole = WholeEvents()
    assert whole.feed(b"data: 1\r\n\r\ndata: 2") == b"data: 1\r\n\r\n" and whole.rest() == b"data: 2"
    huge = b"data: " + b"x" * WholeEvents.HELD_MAX
    assert whole.feed(huge[:10]) == b"" and whole.feed(huge[10:]) == huge  # not held without end


def test_a_broken_part_counts_a_token_an_event_and_what_was_sent_is_read_past_a_bound() -> None:
    class Small(SentEvents):
        KEPT_MAX = 200  # read into the stitcher every few events, as a long stream is past 1 MiB

    sent = Small(COMPLETIONS)
    for i in range(12):
        sent.add(_chunk("cmpl-1", text=f"t{i} "))
    stitcher = sent.stitcher(client_usage=True)
    end = stitcher.end_broken()  # its worker died: no usage event came
    assert (end.reason, end.part_written, end.written, end.text) == (None, 12, 12, "".join(f"t{i} " for i in range(12)))
    assert stitcher.end_broken().written == 12  # ended once: asked again, it counts nothing more
    stitcher.begin_part()  # the next worker goes on; its prompt is the first's and the text so far
    stitcher.feed(_chunk("cmpl-2", text="t12 ", reason="stop") + _usage("cmpl-2", 3 + 12, 1))
    stitcher.end_part()
    client, _ = stitcher.finish()
    usage = next(e for e in _events(client) if isinstance(e, dict) and e.get("usage"))
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 13, "total_tokens": 16}


def test_content_events_go_on_unread_whatever_the_json_spacing_and_their_text_is_read_when_needed() -> None:
    import json

    s = StreamStitcher(CHAT, client_usage=False)
    s.begin_part()
    spaced = b"data: " + json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"content": " two"},
                                     "finish_reason": None}], "usage": None}).encode() + b"\n\n"  # fmt: skip
    events = _chunk("a", {"role": "assistant", "content": ""}) + _chunk("a", {"content": "one"}) + spaced
    assert s.feed(events) == events  # byte for byte: nothing rewritten
    end = s.end_broken()  # the worker broke: a token counted for each event that carried text
    assert (end.reason, end.part_written, end.text) == (None, 2, "one two")
