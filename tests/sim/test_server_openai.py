"""The simulated server over real sockets, with the openai client as the client."""

from __future__ import annotations

import openai
import pytest

from tests.sim.helpers import SimProcess, start_sim

MODEL = "sim-llama"


@pytest.fixture(scope="module")
def sim():
    s = start_sim(
        "--served-model-name",
        MODEL,
        "--sim-time-scale",
        "50",
        "--enable-metrics",
        "--log-level",
        "info",
        "--trust-remote-code",
    )
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "sglang"
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_stops_at_the_scripted_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=40,
        extra_body={"sim_output_len": 6, "top_k": 5, "foo": 1},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert len(choice.message.content.split()) == 6
    assert resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens > 3 and resp.usage.total_tokens == resp.usage.prompt_tokens + 6


def test_chat_length_limit(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a lot"}], max_tokens=4
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4


def test_chat_stream_one_token_per_chunk_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"sim_output_len": 12},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 12
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_and_stream(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8
    text = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once", max_tokens=5, stream=True)
    )
    assert len(text.split()) == 5


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="x", max_tokens=9, extra_body={"sim_output_len": 2, "ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 9


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[])
    assert "messages" in str(err.value)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert "maximum context length" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_chat_continues_its_final_assistant_message_as_sglang_does(client: openai.OpenAI) -> None:
    """``continue_final_message``: the last assistant message leaves the template and its text ends the
    prompt, open: the prompt is the plain conversation's (generation prompt included) plus that text,
    and the answer goes on from it (its first word after a space)."""
    turn = [{"role": "user", "content": "Say hello"}]
    plain = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, extra_body={"sim_output_len": 4})
    so_far = "hi my dear pal"  # words of up to four characters: a token each
    more = client.chat.completions.create(
        model=MODEL,
        messages=[*turn, {"role": "assistant", "content": so_far}],  # type: ignore[list-item]
        max_tokens=5,
        extra_body={"sim_output_len": 3, "continue_final_message": True},
    )
    assert more.usage.prompt_tokens == plain.usage.prompt_tokens + len(so_far.split())
    text = more.choices[0].message.content or ""
    assert text.startswith(" ") and len(text.split()) == 3 and more.choices[0].finish_reason == "stop"
    as_turn = client.chat.completions.create(
        model=MODEL,
        messages=[*turn, {"role": "assistant", "content": so_far}],
        max_tokens=2,  # type: ignore[list-item]
    )
    assert as_turn.usage.prompt_tokens > more.usage.prompt_tokens  # without the flag: a whole turn, then a new one
