"""policies/sim-8gpu-two-models.toml through ``pacer serve``: one proxy in front of two pools of
real simulated workers (a 70B-class model at tp 4 on GPUs 0-3, four 8B replicas on GPUs 4-7).

Each worker process has its GPUs in its environment, each request reaches the pool serving its
model, an unknown model is a 404 naming the served ones, and a worker of one pool that dies is
revived in its pool (same GPU, same flags) while the other pool's workers keep running."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.harness.serve_process import pacer_serve
from tests.harness.wait import wait_until

POLICY = Path(__file__).parents[2] / "policies" / "sim-8gpu-two-models.toml"
BIG, SMALL = "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"
EXPECTED_GPUS = {"llama-70b-w0": "0,1,2,3", **{f"llama-8b-w{i}": str(4 + i) for i in range(4)}}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    # advise: a dead worker is revived as it was, and no tuning restarts a worker while the test runs
    # (the 70B pool's ranks start with ~13 GB free, which the controller in auto would use)
    text = POLICY.read_text().replace('mode = "auto"', 'mode = "advise"', 1)
    assert 'mode = "advise"' in text
    (tmp_path / "policy.toml").write_text(text)
    with pacer_serve(tmp_path) as served:
        yield served


async def workers(url: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
        return {w["id"]: w for w in (await r.json())["workers"]}


async def wait_all_ready(url: str, log: Path, timeout: float = 60.0, count: int = 5) -> dict[str, dict[str, Any]]:
    """The proxy's ``count`` workers once every one is ready with a process."""

    async def all_ready() -> dict[str, dict[str, Any]] | None:
        try:
            ws = await workers(url)
        except (aiohttp.ClientError, OSError, ValueError, KeyError):
            return None  # the proxy is not listening yet
        return ws if len(ws) == count and all(w["state"] == "ready" and w["pid"] for w in ws.values()) else None

    return await wait_until(
        all_ready, f"{count} workers ready", timeout=timeout, every=0.1, detail=lambda: log.read_text()[-3000:]
    )


async def served(ws: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Requests each pool's workers processed, as the workers themselves count them."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as s:
        for w in ws.values():
            async with s.get(w["url"] + "/metrics") as r:
                text = await r.text()
            n = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("sglang:num_requests_total"))
            out[w["pool"]] = out.get(w["pool"], 0.0) + n
    return out


def visible_devices(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


async def test_two_pools_behind_one_proxy(fleet: tuple[str, Path]) -> None:
    url, log = fleet
    ws = await wait_all_ready(url, log)
    for wid, w in ws.items():
        assert visible_devices(w["pid"]) == EXPECTED_GPUS[wid], wid
        assert w["gpus"] == [int(g) for g in EXPECTED_GPUS[wid].split(",")]
        assert (w["pool"], w["model"]) == (("llama-70b", BIG) if wid.startswith("llama-70b") else ("llama-8b", SMALL))
        assert w["args"]["tp_size"] == (4 if w["pool"] == "llama-70b" else 1)
        assert w["args"]["served_model_name"] == w["model"]

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    async with client:
        assert {m.id for m in (await client.models.list()).data} == {BIG, SMALL}

        async def ask(model: str) -> str:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            return r.model

        answers = await asyncio.gather(*(ask(m) for m in [BIG, SMALL] * 10))
        assert answers == [BIG, SMALL] * 10
        # no model with several pools: a 400 naming them (no pool is the default); /generate may name one
        async with aiohttp.ClientSession() as s:
            for path, body in [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
            ]:
                async with s.post(url + path, json=body) as r:
                    err = (await r.json())["error"]
                    assert r.status == 400 and (err["param"], err["code"]) == ("model", "model_required"), err
                    assert BIG in err["message"] and SMALL in err["message"]
            gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "model": SMALL}
            async with s.post(url + "/generate", json=gen) as r:
                assert r.status == 200, await r.text()
                assert "text" in await r.json()
        counts: dict[str, float] = {}

        async def each_pool_did_its_own() -> bool:
            counts.update(await served(ws))
            assert counts["llama-70b"] <= 10 and counts["llama-8b"] <= 11, counts
            return counts == {"llama-70b": 10, "llama-8b": 11}

        await wait_until(
            each_pool_did_its_own, "each pool's workers to count its own requests", detail=lambda: str(counts)
        )

        with pytest.raises(openai.NotFoundError) as err:
            await ask("gpt-4")
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
        assert BIG in body["message"] and SMALL in body["message"]

        # a worker of the 8B pool dies: revived in its pool on its GPU; the 70B worker is untouched
        victim = ws["llama-8b-w2"]
        os.kill(victim["pid"], signal.SIGKILL)
        now: dict[str, dict[str, Any]] = {}

        async def revived() -> bool:
            now.update(await workers(url))
            w = now["llama-8b-w2"]
            return w["state"] == "ready" and w["pid"] not in (None, victim["pid"])

        await wait_until(revived, "llama-8b-w2 revived", timeout=60, detail=lambda: log.read_text()[-2000:])
        w = now["llama-8b-w2"]
        assert visible_devices(w["pid"]) == "6" and w["restarts"] == 1
        for wid in EXPECTED_GPUS:
            if wid != "llama-8b-w2":
                assert (now[wid]["pid"], now[wid]["restarts"]) == (ws[wid]["pid"], 0), wid
        assert await asyncio.gather(ask(SMALL), ask(BIG)) == [SMALL, BIG]
