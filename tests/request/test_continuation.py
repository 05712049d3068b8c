"""The output budget's request shapes: which requests go under a budget, the continuation of an
answer, reading a part and merging the parts into one answer (pure functions)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.engines.sglang.engine import SGLANG, SIM
from proxy.engines.vllm.engine import VLLM
from proxy.request.continuation import CHAT, COMPLETIONS, Capped, continuation_body, merge, plan, read_part
from proxy.request.job import Job

MESSAGES = [{"role": "user", "content": "hi"}]


def _job(path: str = CHAT, stream: bool = False, **body: Any) -> Job:
    base: dict[str, Any] = {"model": "m", "max_tokens": 4096}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Once upon"})
    base.update(body)
    base = {k: v for k, v in base.items() if v is not ...}
    return Job(path, base, stream, "m", None, True)


def test_a_plain_request_goes_at_the_budget_and_keeps_its_own_max_tokens():
    job = _job()
    capped = plan(job, 512)
    assert capped == Capped(field="max_tokens", asked=4096, sent=512)
    assert capped.body(job.body)["max_tokens"] == 512 and job.body["max_tokens"] == 4096
    newer = plan(_job(max_tokens=..., max_completion_tokens=2000), 512)
    assert newer == Capped(field="max_completion_tokens", asked=2000, sent=512)
    assert plan(_job(COMPLETIONS, temperature=0.7, top_p=0.9, n=1, logprobs=None, stop=None), 512) is not None


@pytest.mark.parametrize(
    ("budget", "body"),
    [
        pytest.param(None, {}, id="no-budget"),
        pytest.param(3500, {}, id="saves-too-little"),
        pytest.param(512, {"max_tokens": ...}, id="no-max-tokens"),
        pytest.param(512, {"max_tokens": True}, id="max-tokens-not-a-number"),
        pytest.param(512, {"n": 2}, id="several-choices"),
        pytest.param(512, {"logprobs": True}, id="logprobs"),
        pytest.param(512, {"stop": ["\n\n"]}, id="stop-strings"),
        pytest.param(512, {"tools": [{"type": "function"}]}, id="tools"),
        pytest.param(512, {"response_format": {"type": "json_object"}}, id="structured-output"),
        pytest.param(512, {"regex": "[a-z]+"}, id="regex"),
        pytest.param(512, {"frequency_penalty": 0.5}, id="penalty"),
        pytest.param(512, {"min_tokens": 600}, id="min-tokens"),
        pytest.param(512, {"seed": 7}, id="seed"),
        pytest.param(512, {"ignore_eos": True}, id="ignore-eos"),
        pytest.param(512, {"messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}]}, id="client-prefill"),
    ],
)
def test_requests_a_continuation_would_change_go_as_they_came(budget: int | None, body: dict[str, Any]) -> None:
    assert plan(_job(**body), budget) is None


def test_generate_and_token_prompts_go_as_they_came_and_streams_go_under_the_budget():
    assert plan(_job(stream=True, stream_options={"include_usage": True}), 512) is not None
    assert (
        plan(Job("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4096}}, False, None, None, True), 512)
        is None
    )
    assert plan(_job(COMPLETIONS, prompt=[1, 2, 3]), 512) is None
    assert plan(_job(COMPLETIONS, prompt=["a", "b"]), 512) is None


def test_next_part_asks_for_what_is_left_and_at_most_doubles_the_answer():
    capped = Capped(field="max_tokens", asked=4096, sent=512)
    assert capped.next_cap(512, 512) == 512
    assert capped.next_cap(1024, 512) == 1024
    assert capped.next_cap(3000, 512) == 1096  # what is left of the client's max_tokens


def _answer(path: str, text: str, written: int, reason: str, **choice: Any) -> bytes:
    body = {"message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}}
    c = {"index": 0, **(body if path == CHAT else {"text": text}), "finish_reason": reason, **choice}
    return orjson.dumps({"id": "a1", "object": "x", "model": "m", "choices": [c],
                         "usage": {"prompt_tokens": 9, "completion_tokens": written, "total_tokens": 9 + written}})  # fmt: skip


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_parts_merge_into_one_answer(path: str) -> None:
    first = read_part(path, _answer(path, "one two", 2, "length"))
    second = read_part(path, _answer(path, " three", 1, "stop", matched_stop=128009))
    assert first is not None and second is not None
    assert (first.text, first.completion_tokens, first.finish_reason) == ("one two", 2, "length")
    merged = orjson.loads(merge(path, [first, second]))
    choice = merged["choices"][0]
    assert (choice["message"]["content"] if path == CHAT else choice["text"]) == "one two three"
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 128009
    assert merged["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert merged["id"] == "a1"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b'{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}', id="no-choice"),
        pytest.param(b'{"choices": [{"message": {"content": "x"}}]}', id="no-usage"),
        pytest.param(_answer(CHAT, "x", 1, "length").replace(b'"tool_calls":null', b'"tool_calls":[{"id":"t"}]'),
                     id="tool-call"),
        pytest.param(_answer(CHAT, "x", 1, "length").replace(b'"reasoning_content":null', b'"reasoning_content":"hm"'),
                     id="reasoning"),
    ],
)  # fmt: skip
def test_a_part_that_is_not_one_plain_choice_cannot_be_continued(body: bytes) -> None:
    assert read_part(CHAT, body) is None


def test_the_continuation_carries_the_text_so_far_and_the_engine_fields():
    capped = Capped(field="max_tokens", asked=4096, sent=512)
    job = _job(sim_output_len=1500)
    fields = SIM.continuation_fields(CHAT, job.body, 512)
    more = continuation_body(CHAT, job.body, "one two", capped, 1024, fields)  # type: ignore[arg-type]
    assert more["messages"] == [*MESSAGES, {"role": "assistant", "content": "one two"}]
    assert more["continue_final_message"] is True and more["max_tokens"] == 1024
    assert more["sim_output_len"] == 1500 - 512  # the simulator's true length: what is left of it
    assert job.body["messages"] == MESSAGES  # the job's own body is untouched
    comp = _job(COMPLETIONS)
    more = continuation_body(COMPLETIONS, comp.body, " one two", capped, 512, {})
    assert more["prompt"] == "Once upon one two" and more["max_tokens"] == 512


def test_engines_say_whether_max_tokens_reserves_and_how_they_continue():
    assert SGLANG.reserves_max_tokens and SIM.reserves_max_tokens and not VLLM.reserves_max_tokens
    assert SGLANG.continuation_fields(CHAT, {"sim_output_len": 9}, 3) == {"continue_final_message": True}
    assert VLLM.continuation_fields(CHAT, {}, 3) == {"continue_final_message": True, "add_generation_prompt": False}
    assert SGLANG.continuation_fields(COMPLETIONS, {}, 3) == {} and VLLM.continuation_fields(COMPLETIONS, {}, 3) == {}
    assert (
        SGLANG.continuation_fields("/generate", {}, 3) is None and VLLM.continuation_fields("/generate", {}, 3) is None
    )
