"""Per-request facts: the usage read from whole answers and stream tails, the usage event stripped."""

from __future__ import annotations

import pytest

from proxy.request.facts import RequestFact, WorkerFacts, read_usage, strip_usage, usage_of_stream

USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}'
LAST = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}'


def test_usage_of_whole_answers_and_stream_tails():
    body = b'{"choices":[{"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":9}}'
    assert read_usage(body) == (3, 9, "length", None)
    assert read_usage(b"not json") == (None, None, None, None)
    assert usage_of_stream(LAST + b"\n\n" + USAGE + b"\n\ndata: [DONE]\n\n") == (7, 5, "stop", None)
    assert usage_of_stream(b"data: [DONE]\n\n") == (None, None, None, None)


def test_strip_usage_keeps_every_other_event_and_the_usage_inside_a_choice():
    data = LAST + b"\n\n" + USAGE + b"\n\ndata: [DONE]\n\n"
    assert strip_usage(data) == LAST + b"\n\ndata: [DONE]\n\n"
    assert strip_usage(USAGE + b"\n\n") == b""  # the relay then sends nothing (an empty chunk would end it)
    with_choice = b'data: {"choices":[{"index":0}],"usage":{"completion_tokens":1}}\n\n'
    assert strip_usage(with_choice) == with_choice
    assert strip_usage(LAST) is LAST  # no usage: untouched, not copied


def test_worker_facts_ring_and_figures():
    facts = WorkerFacts(keep=3)
    for i, (out, mx) in enumerate([(10, 100), (50, 100), (90, 100), (400, 500)]):
        facts.record(
            RequestFact(
                time=float(i),
                arrived=float(i) - 1,
                prompt_tokens=20,
                output_tokens=out,
                max_tokens=mx,
                finish_reason="stop",
                ttft_s=0.1 * (i + 1),
                queue_s=0.0,
                interactive=i != 2,
            )
        )
    assert len(facts) == 3 and facts.answered == 4
    assert facts.output_ratio() == 0.8 and facts.mean_output_tokens() == 180.0
    assert facts.mean_output_tokens(since=3.0) == 400.0
    assert facts.summary()["mean_ttft_s"] == 0.3
    assert (
        facts.mean_ttft(interactive=True) == pytest.approx(0.3) and facts.mean_output_tokens(interactive=False) == 90.0
    )
    assert [f.time for f in facts.recent(since=2.0, interactive=True)] == [3.0]
    # sent after a moment: the first tokens of what was dispatched since (arrived i - 1, no proxy queue)
    assert facts.mean_ttft(interactive=True, sent_after=1.5) == pytest.approx(0.4)
    assert facts.mean_ttft(interactive=True, sent_after=2.0) is None
    assert RequestFact(time=0, arrived=0, prompt_tokens=1, output_tokens=3, max_tokens=None, finish_reason=None, ttft_s=None,
                       queue_s=0).output_ratio is None  # fmt: skip


def test_written_reads_a_class_and_only_the_requests_that_arrived_before_a_moment():
    facts = WorkerFacts()
    for i, (out, interactive) in enumerate([(10, True), (500, False), (30, True), (20, True)]):
        facts.record(RequestFact(time=10.0 + i, arrived=float(i), prompt_tokens=1, output_tokens=out, max_tokens=4096,
                                 finish_reason="stop", ttft_s=None, queue_s=0.0, interactive=interactive))  # fmt: skip
    assert facts.written(interactive=True) == {4096: [10, 30, 20]}
    assert facts.written(interactive=False) == {4096: [500]}
    assert facts.written(interactive=True, arrived_before=2.0) == {4096: [10]}  # arrived at 0 (and 1, the batch one)
    facts.record(RequestFact(time=20.0, arrived=9.0, prompt_tokens=1, output_tokens=1500, max_tokens=2000,
                             finish_reason="stop", ttft_s=None, queue_s=0.0))  # fmt: skip
    assert facts.written(interactive=True) == {4096: [10, 30, 20], 2000: [1500]}  # requests that ask alike
    # a budget lifted at 2.0 for those asking 4096 reads only what arrived from then on
    later = facts.written(interactive=True, arrived_from=lambda asked: 2.0 if asked == 4096 else -1.0)
    assert later == {4096: [30, 20], 2000: [1500]}


def test_the_answers_a_budget_held_are_those_sent_under_it_that_ended_in_one_part():
    facts = WorkerFacts()
    for queue_s, sent, parts, interactive in [(1.0, 256, 1, True), (3.0, 256, 1, True), (3.0, 256, 3, True),
                                              (3.0, None, 1, True), (3.0, 256, 1, False)]:  # fmt: skip
        facts.record(RequestFact(time=10.0, arrived=0.0, prompt_tokens=1, output_tokens=9, max_tokens=2000,
                                 finish_reason="stop", ttft_s=None, queue_s=queue_s, interactive=interactive,
                                 sent_max_tokens=sent, parts=parts))  # fmt: skip
    assert facts.ended_within_budget(interactive=True, max_tokens=2000, sent_after=2.0) == 1  # sent at 3.0
    assert facts.ended_within_budget(interactive=True, max_tokens=2000, sent_after=0.0) == 2
    assert facts.ended_within_budget(interactive=True, max_tokens=4096, sent_after=0.0) == 0
    assert facts.ended_within_budget(interactive=True, max_tokens=2000, sent_after=0.0, ended_since=10.5) == 0


def test_when_the_worker_got_a_request_and_when_its_first_token_came() -> None:
    stream = RequestFact(time=20.0, arrived=10.0, prompt_tokens=5, output_tokens=9, max_tokens=16,
                         finish_reason="stop", ttft_s=0.5, queue_s=2.0)  # fmt: skip
    assert (stream.dispatched, stream.first_token) == (12.0, 12.5)
    whole = RequestFact(time=20.0, arrived=10.0, prompt_tokens=5, output_tokens=9, max_tokens=16,
                        finish_reason="stop", ttft_s=None, queue_s=2.0)  # fmt: skip
    assert (whole.dispatched, whole.first_token) == (12.0, None)  # a whole answer's first token is not seen


def test_the_cached_tokens_the_engine_reports_are_read_from_a_body_and_a_stream() -> None:
    from proxy.request.facts import read_usage, usage_of_stream

    usage = b'{"usage": {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 6}}}'
    assert read_usage(usage) == (9, 3, None, 6)
    assert read_usage(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 3}}') == (9, 3, None, None)
    assert usage_of_stream(b"data: " + usage + b"\n\ndata: [DONE]\n\n") == (9, 3, None, 6)
