"""The output budget through a real proxy over real sockets, with the openai client, in front of fake
workers that speak the simulator (so a continuation's true length is what is left): a request goes
at its class's budget, an answer that reaches it is continued on the same worker, and the client
gets one answer (every part's text and tokens, the last part's finish reason)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from tests.harness.fake_engine import MODEL
from tests.harness.wait import wait_until

SIM_SPEAKER = {"engine": {"speaks": "sim"}}
pytestmark = pytest.mark.looptime  # the workers' token pace and the scrapes on virtual time


def _sent(h: Any) -> list[tuple[Any, ...]]:
    return [(b.get("max_tokens"), b.get("rid"), b.get("continue_final_message")) for b in h.workers[0].bodies]


async def test_a_chat_answer_past_its_budget_is_continued_into_one_answer(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    load = h.state.board.get("w0")
    load.output_budgets.set((True, 100), 4, 0.0)
    client = h.client()
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100, extra_body={"sim_output_len": 10}
    )
    assert chat.choices[0].message.content == "tok " * 10
    assert chat.choices[0].finish_reason == "stop"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (3, 10, 13)
    sent = _sent(h)
    rid = sent[0][1]
    # 4 at the budget, 4 more (what was written), then 8 (doubling): the last one ends by itself
    assert sent == [(4, rid, None), (4, f"{rid}.c1", True), (8, f"{rid}.c2", True)]
    bodies = h.workers[0].bodies
    assert bodies[1]["messages"][-1] == {"role": "assistant", "content": "tok " * 4}
    assert bodies[2]["messages"][-1] == {"role": "assistant", "content": "tok " * 8}
    assert [b["sim_output_len"] for b in bodies] == [10, 6, 2]  # the simulator's true length, what is left
    fact = load.facts.recent()[-1]
    assert (fact.output_tokens, fact.max_tokens, fact.sent_max_tokens, fact.parts) == (10, 100, 4, 3)
    assert fact.finish_reason == "stop"
    await client.close()


async def test_a_completion_goes_on_from_its_prompt_and_stops_at_the_clients_max_tokens(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    h.state.board.get("w0").output_budgets.set((True, 6), 4, 0.0)
    client = h.client()
    comp = await client.completions.create(model=MODEL, prompt="x", max_tokens=6, extra_body={"sim_output_len": 50})
    assert comp.choices[0].text == "tok " * 6 and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 6
    bodies = h.workers[0].bodies
    assert [b["max_tokens"] for b in bodies] == [4, 2]  # the second asks only for what the client has left
    assert bodies[1]["prompt"] == "x" + "tok " * 4 and "continue_final_message" not in bodies[1]
    await client.close()


async def test_short_answers_take_one_part_and_other_requests_go_as_asked(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    h.state.board.get("w0").output_budgets.set((True, 100), 8, 0.0)
    client = h.client()
    msg = [{"role": "user", "content": "hi"}]
    short = await client.chat.completions.create(
        model=MODEL, messages=msg, max_tokens=100, extra_body={"sim_output_len": 3}
    )
    assert short.choices[0].message.content == "tok " * 3 and short.usage.completion_tokens == 3
    await client.chat.completions.create(
        model=MODEL, messages=msg, max_tokens=100, stop=["\n"], extra_body={"sim_output_len": 3}
    )
    await client.chat.completions.create(  # the batch class has no budget of its own yet
        model=MODEL, messages=msg, max_tokens=100, extra_body={"sim_output_len": 3},
        extra_headers={"x-pacer-priority": "batch"},
    )  # fmt: skip
    # requests that ask for another max_tokens write otherwise: no budget of theirs yet
    await client.chat.completions.create(model=MODEL, messages=msg, max_tokens=50, extra_body={"sim_output_len": 3})
    assert [b["max_tokens"] for b in h.workers[0].bodies] == [8, 100, 100, 50]
    await client.close()


async def test_a_budget_the_controller_holds_back_sends_the_requests_as_before_it_until_released(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    budgets = h.state.board.get("w0").output_budgets
    budgets.set((True, 100), 8, 0.0)
    around = next(iter(h.state.controllers.values())).surroundings  # the controller's way to hold one back
    client = h.client()
    msg = [{"role": "user", "content": "hi"}]
    short = {"sim_output_len": 3}

    async def ask() -> None:
        await client.chat.completions.create(model=MODEL, messages=msg, max_tokens=100, extra_body=short)

    await ask()
    around.hold_back_budget("w0", True, 100, None)  # as asked
    await ask()
    around.hold_back_budget("w0", True, 100, 16)  # a moved budget's check: as the budget before it
    await ask()
    assert budgets.get((True, 100)) == 8  # the budget kept
    around.release_budget("w0", True, 100)
    await ask()
    assert [b["max_tokens"] for b in h.workers[0].bodies] == [8, 100, 16, 8]
    around.hold_back_budget("w0", True, 100, 4)  # what reaches the cap it is held back to is not the budget's overrun
    await client.chat.completions.create(model=MODEL, messages=msg, max_tokens=100, extra_body={"sim_output_len": 6})
    assert h.workers[0].bodies[-2]["max_tokens"] == 4 and budgets.reached((True, 100)) == 0
    budgets.set((True, 100), None, 1.0)  # lifted meanwhile: nothing held back is left behind
    budgets.set((True, 100), 8, 2.0)
    await ask()
    assert h.workers[0].bodies[-1]["max_tokens"] == 8
    await client.close()


@pytest.mark.parametrize("failure", ["400", "500"])
async def test_a_part_the_worker_refuses_sends_the_request_again_whole(make_proxy, failure: str) -> None:
    h = await make_proxy(policy=SIM_SPEAKER)
    h.state.board.get("w0").output_budgets.set((True, 100), 4, 0.0)
    w = h.workers[0]
    w.fail_next("ok")
    w.fail_next(failure)  # the continuation fails
    client = h.client()
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100, extra_body={"sim_output_len": 10}
    )
    assert chat.choices[0].message.content == "tok " * 10 and chat.usage.completion_tokens == 10
    if failure == "400":  # refused: the same attempt sends it again as the client asked
        assert [b["max_tokens"] for b in w.bodies] == [4, 4, 100]
        assert w.bodies[2]["rid"] == w.bodies[0]["rid"] + ".w"
    else:  # a 5xx fails the attempt before any output: the retry starts again, under the budget
        assert [b["max_tokens"] for b in w.bodies] == [4, 4, 4, 4, 8]
    async with aiohttp.ClientSession() as s, s.get(h.url + "/metrics") as r:
        metrics = await r.text()
    assert ('pacer_output_budget_redone_total{pool="default"} 1.0' in metrics) is (failure == "400")
    continued = 1 if failure == "400" else 3  # the failed one, then the retry's two
    assert f'pacer_output_budget_continuations_total{{pool="default"}} {continued:.1f}' in metrics
    await client.close()


async def test_a_client_that_leaves_during_a_continuation_has_that_part_aborted(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER, worker={"token_delay_s": 0.05})
    h.state.board.get("w0").output_budgets.set((True, 400), 4, 0.0)
    w = h.workers[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "sim_output_len": 200}
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(h.url + "/v1/chat/completions", json=body))
        await wait_until(
            lambda: len(w.bodies) == 2, "len(w.bodies) == 2"
        )  # the first part answered, the second running
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_until(lambda: w.bodies[1]["rid"] in w.aborted, "w.bodies[1]['rid'] in w.aborted")
    await wait_until(lambda: h.state.board.get("w0").in_flight == 0, "h.state.board.get('w0').in_flight == 0")
    assert len(w.bodies) == 2  # nothing more was sent for it


async def test_a_streamed_answer_past_its_budget_comes_as_one_stream(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    h.state.board.get("w0").output_budgets.set((True, 100), 4, 0.0)
    client = h.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100, stream=True,
        stream_options={"include_usage": True}, extra_body={"sim_output_len": 10},
    )  # fmt: skip
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3 " + "t0 t1 t2 t3 " + "t0 t1 "  # each fake part counts from t0
    assert {c.id for c in chunks} == {"cmpl-1"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]  # the parts' "length" never reaches the client
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 3
    bodies = h.workers[0].bodies
    assert [b["max_tokens"] for b in bodies] == [4, 4, 8]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert bodies[2]["messages"][-1] == {"role": "assistant", "content": "t0 t1 t2 t3 t0 t1 t2 t3 "}
    fact = h.state.board.get("w0").facts.recent()[-1]
    assert (fact.output_tokens, fact.parts, fact.finish_reason) == (10, 3, "stop")
    # a client that did not ask for the usage does not get it; the facts still read it
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=100, stream=True,
                                             extra_body={"sim_output_len": 6})  # fmt: skip
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks) and "".join(c.choices[0].text for c in chunks) == "t0 t1 t2 t3 t0 t1 "
    assert h.state.board.get("w0").facts.recent()[-1].output_tokens == 6
    await client.close()


async def test_a_continuation_the_worker_refuses_once_is_asked_again_and_the_stream_is_whole(make_proxy):
    h = await make_proxy(policy=SIM_SPEAKER)
    h.state.board.get("w0").output_budgets.set((True, 100), 4, 0.0)
    w = h.workers[0]
    w.fail_next("ok")
    w.fail_next("400")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True, "sim_output_len": 10}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/completions", json=body) as r:
        raw = await r.read()
    assert b"error" not in raw and raw.count(b'"text":"t') == 10 and raw.endswith(b"data: [DONE]\n\n")
    rid = w.bodies[0]["rid"]
    assert [b["rid"] for b in w.bodies] == [rid, f"{rid}.c1", f"{rid}.c1r", f"{rid}.c2"]  # c1 refused, asked again
    await wait_until(lambda: h.state.board.get("w0").in_flight == 0, "the workers empty")


async def test_a_continuation_refused_everywhere_ends_the_stream_with_one_error_event(make_proxy):
    h = await make_proxy(n_workers=2, policy={**SIM_SPEAKER, "pacing": {"max_attempts": 2}})
    for i in range(2):
        h.state.board.get(f"w{i}").output_budgets.set((True, 100), 4, 0.0)
    h.workers[0].fail_next("ok")
    for w in h.workers:
        w.fail_next("400", 50)
    h.workers[1].fail_next("500", 0)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True, "sim_output_len": 10}
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/completions", json=body) as r:
        raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert b"t3" in raw and b'"finish_reason":"length"' not in raw
    assert raw.count(b"upstream_failed_mid_stream") == 1 and b"could not go on" in events[-2]
    assert events[-1] == b"data: [DONE]"
    suffixes = [b["rid"].split(".", 2)[-1] for w in h.workers for b in w.bodies]
    assert {"c1", "c1r"} <= set(suffixes) and sum(s.endswith(("g", "gr")) for s in suffixes) >= 2  # then elsewhere
    for w in h.workers:
        w.fail_none()
    await wait_until(lambda: all(h.state.board.get(f"w{i}").in_flight == 0 for i in range(2)), "the workers empty")


@pytest.mark.parametrize("budget", [None, 4])
async def test_a_worker_that_fails_one_request_in_three_fails_as_many_streams_with_the_budget_as_without(
    make_proxy, budget: int | None
) -> None:
    """The budget turns one request into several: a worker that fails some of its requests must not
    cost a stream more often because of it. Every third request each worker gets fails (HTTP 500);
    with the budget off and on, no stream fails: a failure before output is tried again, a refused
    continuation is asked again and then goes elsewhere."""
    h = await make_proxy(n_workers=2, policy=SIM_SPEAKER)
    for i, w in enumerate(h.workers):
        if budget is not None:
            h.state.board.get(f"w{i}").output_budgets.set((True, 100), budget, 0.0)
        for _ in range(40):
            w.fail_next("ok", 2)
            w.fail_next("500")

    async def stream(i: int) -> bool:
        body = {"model": MODEL, "prompt": f"x{i}", "max_tokens": 100, "stream": True, "sim_output_len": 10}
        async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/completions", json=body) as r:
            raw = await r.read()
        return r.status == 200 and b"error" not in raw and raw.count(b'"text":"t') == 10

    whole = [await stream(i) for i in range(20)]
    assert whole.count(False) == 0
    failed = sum(len(w.bodies) for w in h.workers) - 20 * (3 if budget else 1)  # requests past one a part
    assert failed > 0  # the workers did fail requests under it
    for w in h.workers:
        w.fail_none()


async def test_a_whole_answer_taken_back_keeps_what_its_worker_wrote(make_proxy):
    """A rolling restart takes a request back from its worker: the worker ends it early and answers
    what it wrote (SGLang's graceful abort), and the next attempt goes on from that text instead of
    starting over. The client gets one answer with every token."""
    h = await make_proxy(policy=SIM_SPEAKER, worker={"token_delay_s": 0.02, "answer_aborts": True})
    w = h.workers[0]
    client = h.client()
    task = asyncio.ensure_future(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100, extra_body={"sim_output_len": 40}
        )
    )
    await wait_until(lambda: len(w.bodies) == 1, "len(w.bodies) == 1")
    await wait_until(lambda: w.written >= 10, "ten tokens written")
    assert h.state.requests.dispatcher_of("default").take_back("w0") == 1
    await wait_until(lambda: len(w.bodies) == 2, "len(w.bodies) == 2")
    (going_on,) = h.state.board.get("w0").attempts  # open: what the planner reads of it
    assert going_on.going_on_from == w.bodies[0]["sim_output_len"] - w.bodies[1]["sim_output_len"]
    chat = await task
    assert chat.choices[0].message.content == "tok " * 40 and chat.usage.completion_tokens == 40
    assert chat.choices[0].finish_reason == "stop" and chat.usage.prompt_tokens == 3
    first, second = w.bodies
    assert w.aborted == [first["rid"]]
    kept = first["sim_output_len"] - second["sim_output_len"]  # what the first worker wrote
    assert 5 <= kept < 40
    assert second["messages"][-1] == {"role": "assistant", "content": "tok " * kept}
    assert second["continue_final_message"] is True and second["max_tokens"] == 100 - kept
    assert second["rid"].endswith(".r") and second["rid"] != first["rid"]
    fact = h.state.board.get("w0").facts.recent()[-1]
    assert (fact.output_tokens, fact.parts, fact.written_before) == (40, 2, kept)  # the second went on from kept
    assert h.state.metrics.registry.get_sample_value("pacer_requests_requeued_total", {"pool": "default"}) == 1
    await client.close()


async def test_an_early_end_whose_abort_found_nothing_is_asked_again(make_proxy):
    """An abort that reaches the worker before the request it names (read on another connection, not
    registered yet) finds nothing, and the request would run to its end, holding a worker that is
    about to restart: the abort is posted again while the attempt is open."""
    h = await make_proxy(policy=SIM_SPEAKER, worker={"token_delay_s": 0.02, "answer_aborts": True, "miss_aborts": 2})
    w = h.workers[0]
    client = h.client()
    task = asyncio.ensure_future(
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000, extra_body={"sim_output_len": 400})
    )
    await wait_until(lambda: len(w.bodies) == 1, "len(w.bodies) == 1")
    await wait_until(lambda: w.written >= 5, "five tokens written")
    loop = asyncio.get_running_loop()
    asked = loop.time()
    assert h.state.requests.dispatcher_of("default").take_back("w0") == 1
    await wait_until(lambda: len(w.bodies) == 2, "len(w.bodies) == 2")  # ended there, continued from what it wrote
    assert loop.time() - asked < 2.0  # not the 8 s its whole answer takes there
    first = w.bodies[0]["rid"]
    assert w.aborted == [first] * 3  # the first two aborts found nothing; the third ended it
    comp = await task
    assert comp.choices[0].text == "tok " * 400 and comp.usage.completion_tokens == 400
    await client.close()


async def test_a_worker_that_does_not_answer_an_early_end_has_the_request_taken_back_whole(make_proxy):
    """An engine said to answer an abort with what it wrote but that drops the request instead: the
    take-back still ends the attempt (the connection closes), and the request starts over, no attempt
    spent."""
    h = await make_proxy(
        policy=SIM_SPEAKER,
        worker={"token_delay_s": 0.02},
    )
    w = h.workers[0]
    client = h.client()
    task = asyncio.ensure_future(
        client.completions.create(model=MODEL, prompt="x", max_tokens=100, extra_body={"sim_output_len": 20})
    )
    await wait_until(lambda: len(w.bodies) == 1, "len(w.bodies) == 1")
    assert h.state.requests.dispatcher_of("default").take_back("w0") == 1
    comp = await task
    assert comp.choices[0].text == "tok " * 20
    assert [b["max_tokens"] for b in w.bodies] == [100, 100]  # from the start: nothing was kept
    assert h.state.board.get("w0").facts.recent()[-1].written_before == 0
    await client.close()
