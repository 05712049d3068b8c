"""The output budget end to end: a real simulated SGLang worker behind the whole proxy in auto mode,
the openai client as the client. The fast tier learns the budget from what the worker's answers
wrote; a longer answer reaches it, is continued (the simulator's ``continue_final_message`` for chat,
the prompt that ends with the text for completions) and comes back as one answer, every token of it,
whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.harness.wait import wait_until

from .e2e import MODEL, running_proxy

SHORT = 40  # what the first answers write, of max_tokens 2000
LONG = 600  # then one answer this long


@contextlib.asynccontextmanager
async def _sim_proxy(tmp_path: Path, *, time_scale: float) -> AsyncIterator[tuple[Any, Any, Any]]:
    """The whole proxy in auto mode (no restarts) before one simulated worker at ``time_scale``:
    the proxy, its worker's load, an openai client (closed at the end)."""
    async with running_proxy(
        tmp_path,
        args={"schedule_conservativeness": 1.0},
        extra_args=["--sim-time-scale", str(time_scale)],
        control={"mode": "auto", "restarts_per_hour": 0},
    ) as proxy:
        load = proxy.state.board.get(proxy.state.pool.workers()[0].id)
        client = proxy.client()
        try:
            yield proxy, load, client
        finally:
            await client.close()


async def _short_answers(client: Any, msg: list[dict[str, str]], n: int = 60) -> None:
    """``n`` answers of ``SHORT`` tokens asking for 2,000: what the budget is first learned from."""
    await asyncio.gather(*[
        client.chat.completions.create(model=MODEL, messages=msg, max_tokens=2000, extra_body={"sim_output_len": SHORT})
        for _ in range(n)
    ])  # fmt: skip


async def test_a_budget_learned_from_short_answers_continues_a_long_one_into_one_answer(tmp_path: Path) -> None:
    async with _sim_proxy(tmp_path, time_scale=50) as (proxy, load, client):
        msg = [{"role": "user", "content": "hello there"}]
        await _short_answers(client, msg)
        budget = lambda: load.output_budget(interactive=True, max_tokens=2000)  # noqa: E731
        await wait_until(lambda: budget() is not None, "a budget learned")
        assert budget() == 256  # the floor: 40 x 1.5 is less
        (entry,) = [d for d in await proxy.decisions() if d["rule"] == "output_budget"]
        assert entry["status"] == "applied" and entry["action"] == "note"  # the fast tier: no restart
        assert entry["evidence"]["budget_tokens"] == 256 and entry["evidence"]["previous_tokens"] is None
        assert entry["evidence"]["high_tokens"] == SHORT and entry["evidence"]["request_class"] == "interactive"
        assert entry["evidence"]["applies_above_tokens"] == 342  # a quarter below the client's max_tokens at least
        assert "interactive requests asking for max_tokens 2000 go with 256" in entry["reason"]

        chat = await client.chat.completions.create(
            model=MODEL, messages=msg, max_tokens=2000, extra_body={"sim_output_len": LONG}
        )
        text = chat.choices[0].message.content or ""
        assert len(text.split()) == LONG and chat.usage.completion_tokens == LONG  # every token, one answer
        assert chat.choices[0].finish_reason == "stop"
        fact = load.facts.recent()[-1]
        assert (fact.parts, fact.sent_max_tokens, fact.output_tokens) == (3, 256, LONG)  # 256, 256, then 88

        # the budget follows the answers: 600 is now the highest of the 61 that asked for 2000 (x 1.5 -> 960)
        await wait_until(lambda: budget() == 960, "the budget grown")
        moved = [d["evidence"] for d in await proxy.decisions() if d["rule"] == "output_budget"][-1]
        assert (moved["previous_tokens"], moved["budget_tokens"]) == (256, 960)  # journaled: moved by 25 % or more
        stream = await client.chat.completions.create(
            model=MODEL, messages=msg, max_tokens=2000, stream=True, stream_options={"include_usage": True},
            extra_body={"sim_output_len": 1500},
        )  # fmt: skip
        chunks = [c async for c in stream]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(streamed.split()) == 1500 and chunks[-1].usage.completion_tokens == 1500  # 960, then 540
        assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        assert len({c.id for c in chunks}) == 1

        # now 1500 x 1.5: a budget too close to the 2000 asked changes no request
        await wait_until(lambda: (budget() or 0) > 1500, "the budget past three quarters of what is asked")
        comp = await client.completions.create(
            model=MODEL, prompt="tell me a story", max_tokens=2000, extra_body={"sim_output_len": 5000}
        )
        assert len(comp.choices[0].text.split()) == 2000 and comp.choices[0].finish_reason == "length"
        assert load.facts.recent()[-1].parts == 1 and load.facts.recent()[-1].sent_max_tokens is None
        continued = proxy.state.metrics.registry.get_sample_value(
            "pacer_output_budget_continuations_total", {"pool": "default"}
        )
        assert continued == 2 + 1  # 256 -> 512 -> 600; 960 -> 1500


async def test_requests_taken_back_by_a_restart_keep_what_the_worker_wrote(tmp_path: Path) -> None:
    """A rolling restart that cannot wait for long answers: the drain ends, the requests still running
    are ended early on the worker (SGLang's graceful abort answers what each wrote), and the
    restarted worker goes on from that text: every answer complete, in two parts, nothing written
    twice."""
    async with running_proxy(
        tmp_path,
        args={"schedule_conservativeness": 1.0},
        extra_args=["--sim-time-scale", "5"],  # 1,500 tokens take the batch of 8 about 4.5 s
        control={"mode": "auto", "restarts_per_hour": 0, "drain_timeout_s": 0.5, "output_budget": False},
    ) as proxy:
        worker = proxy.state.pool.workers()[0].id
        load = proxy.state.board.get(worker)
        client = proxy.client()
        try:
            answers = asyncio.gather(*[
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                                               max_tokens=3000, extra_body={"sim_output_len": 1500})
                for i in range(8)
            ])  # fmt: skip
            await wait_until(lambda: load.in_flight == 8 and (load.sample is not None and load.sample.running == 8),
                             "all running")  # fmt: skip
            held = await proxy.worker_metric(worker, "sglang:num_used_tokens")

            async def written_each() -> bool:  # a few hundred tokens each (8 x 200 more in the KV cache)
                return await proxy.worker_metric(worker, "sglang:num_used_tokens") >= held + 8 * 200

            await wait_until(written_each, "a few hundred tokens written each", every=0.1)
            controller = proxy.state.controllers[proxy.state.pool.get(worker).pool]
            result = await controller.actor.restart(worker, {"schedule_conservativeness": 0.5}, "test: a restart")
            assert result.drain is not None and result.drain.taken_back == 8
            done = await answers
            assert [len((a.choices[0].message.content or "").split()) for a in done] == [1500] * 8
            assert [a.usage.completion_tokens for a in done] == [1500] * 8
            facts = load.facts.recent()[-8:]
            assert [f.parts for f in facts] == [2] * 8  # what the first worker wrote, then the rest
            assert proxy.state.pool.get(worker).args["schedule_conservativeness"] == 0.5
        finally:
            await client.close()


async def test_answers_that_get_longer_lift_the_budget_while_they_run(tmp_path: Path) -> None:
    """The demo's shift in small: a budget learned from short answers, then a wave of long ones. Each
    reaches the budget in its first part and goes on; none ends for a while, so the whole answers the
    budget is read from cannot say it is too small. The answers reaching it do: the budget is lifted
    while they run (journaled with what reached it), their next parts ask for the rest at once, and it
    is not set again from the short answers of before."""
    async with _sim_proxy(tmp_path, time_scale=10) as (proxy, load, client):
        msg = [{"role": "user", "content": "hello there"}]
        budget = lambda: load.output_budget(interactive=True, max_tokens=2000)  # noqa: E731
        await _short_answers(client, msg)
        await wait_until(lambda: budget() == 256, "a budget learned")
        long = asyncio.gather(*[
            client.chat.completions.create(model=MODEL, messages=msg, max_tokens=2000,
                                           extra_body={"sim_output_len": 1500})
            for _ in range(20)
        ])  # fmt: skip
        await wait_until(lambda: budget() is None, "the budget lifted")
        assert load.in_flight > 0  # while the long answers run, not once they have ended
        lifted = [d for d in await proxy.decisions() if d["rule"] == "output_budget"][-1]
        evidence = lifted["evidence"]
        assert (evidence["previous_tokens"], evidence["budget_tokens"]) == (256, None)
        assert evidence["reached"] >= 8 and "answers are now longer" in lifted["reason"]
        done = await long
        assert [a.usage.completion_tokens for a in done] == [1500] * 20
        # 256, 256 at most before the lift was seen, then the rest in one part (under the budget: 256,
        # 256, 512, 476)
        assert max(f.parts for f in load.facts.recent()[-20:]) <= 3
        # nothing must happen: the fast tier looks again (once a scrape) several times, and the short
        # answers of before do not set it again
        looks = 0

        def looked(worker_id: str, sample: object, _error: str | None) -> None:
            nonlocal looks
            looks += sample is not None and worker_id == load.worker_id

        proxy.state.board.subscribe(looked)  # after the fast tier's own: it has looked when this counts
        try:
            await wait_until(lambda: looks >= 5, "five more looks of the fast tier")
        finally:
            proxy.state.board.unsubscribe(looked)
        assert budget() is None
