"""The prefix sharing the planner replays, end to end: answers through the proxy from a simulated SGLang
worker that reports its cached tokens (``--enable-cache-report``) reach the controller's workload with
their prompt head's key and cached tokens, and the replay gives each group its shared head."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.control.workload import replay, shared_heads

from .e2e import MODEL, running_proxy

HEAD = " ".join(f"h{j:03d}" for j in range(400))  # a 400-token system prompt, shared by every other request


async def test_answers_carry_their_head_key_and_cached_tokens_to_the_planners_workload(tmp_path: Path) -> None:
    async with running_proxy(
        tmp_path,
        args={"schedule_policy": "lpm", "enable_cache_report": True},
        extra_args=["--sim-time-scale", "20"],
        control={"mode": "off"},
    ) as proxy:
        client = proxy.client()
        try:
            for i in range(8):  # one at a time: the head is cached from the first answer on
                own = " ".join(f"q{i}{j:02d}" for j in range(20))
                await client.completions.create(model=MODEL, prompt=f"{HEAD} {own}" if i % 2 else own, max_tokens=8,
                                                extra_body={"sim_output_len": 8})  # fmt: skip
        finally:
            await client.close()
        worker = proxy.state.pool.workers()[0].id
        surroundings = proxy.controller.surroundings
        seen = await asyncio.to_thread(lambda: list(surroundings.recent_requests(worker)))
    assert len(seen) == 8 and all(o.cached_tokens is not None and o.prefix_key is not None for o in seen)
    shared = [o for o in seen if o.prompt_tokens > 400]
    assert len({o.prefix_key for o in shared}) == 1 and max(o.cached_tokens or 0 for o in shared) >= 400
    heads = shared_heads(seen)
    assert list(heads.values()) == [max(o.cached_tokens or 0 for o in shared)]
    assert sum(1 for sp in replay(seen).specs if sp.shared) == 4
