"""An operator's trial through ``pacer try`` against a real ``pacer serve`` in front of two simulated
workers under load (the ``openai`` client): bad input and a trial that cannot start are refused
in words, a clearly bad candidate (a running batch capped to 2) is tried on one worker as a
canary, judged against the other, reverted, and the worker serves with its own arguments again;
every request is answered.

The pool starts ``w1`` with its own flag (``worker_args``), so the revert must bring that flag back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import tomli_w

from tests.harness.serve_process import pacer_serve
from tests.harness.wait import wait_until

MODEL = "sim-model"


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[str]:
    policy = {
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0},
        "engine": {
            "kind": "sim", "workers": 2, "args": {"served_model_name": MODEL},
            "worker_args": [{}, {"schedule_conservativeness": 0.8}],
            "extra_args": ["--sim-time-scale", "30"], "log_dir": str(tmp_path / "logs"), "stop_grace_s": 1.0,
        },
        "pacing": {"queue_band": [4, 64], "headroom": 8, "scrape_interval_s": 0.1, "stale_after_s": 1.0},
        # the controller may not restart anything (restarts_per_hour 0): only the trial and its canary act;
        # its constants run on the workers' clock, 30 x the wall's (a window of 2 s, a look every 0.17 s)
        "control": {"mode": "auto", "restarts_per_hour": 0, "journal_path": str(tmp_path / "decisions.jsonl")},
    }  # fmt: skip
    (tmp_path / "policy.toml").write_text(tomli_w.dumps(policy))
    with pacer_serve(tmp_path) as (url, _log):
        yield url


def pacer_try(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "try", "--url", url, *args], capture_output=True, text=True, timeout=30
    )


async def _get(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        return await r.json()


async def _load(url: str, stop: asyncio.Event, answers: list[int], failures: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one_client() -> None:
        while not stop.is_set():
            try:
                r = await client.completions.create(model=MODEL, prompt="say something long", max_tokens=48,
                                                    extra_body={"sim_output_len": 48})  # fmt: skip
                answers.append(r.usage.completion_tokens if r.usage else 0)
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    await asyncio.gather(*(one_client() for _ in range(48)))
    await client.close()


async def test_a_bad_trial_is_tried_as_a_canary_and_reverted(proxy: str) -> None:
    url = proxy
    async with aiohttp.ClientSession() as s:
        await wait_until(lambda: _ready(s, url), "the proxy is ready", timeout=60, every=0.2)
        workers = {w["id"]: w for w in (await _get(s, url + "/admin/workers"))["workers"]}
        assert workers["w1"]["args"]["schedule_conservativeness"] == 0.8  # its own flag over the pool's
        assert "schedule_conservativeness" not in workers["w0"]["args"]
        original = dict(workers["w1"]["args"])

        refused = pacer_try(url, "--worker", "w9", "--args", "max_running_requests=2")
        assert refused.returncode == 1 and "answered 404" in refused.stderr and "no worker 'w9'" in refused.stderr
        refused = pacer_try(url, "--worker", "w1", "--args", "max_runing_requests=2")
        assert refused.returncode == 1 and "answered 400" in refused.stderr
        assert "did you mean 'max_running_requests'" in refused.stderr
        async with s.post(url + "/admin/trial", json={"worker": "w1"}) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "args"
            assert 'e.g. {"max_running_requests": 4}' in body["error"]["message"]  # the pool's engine's name
        async with s.post(url + "/admin/trial", json={"worker": "w1", "args": {"model_path": "other/model"}}) as r:
            body = await r.json()  # another model on one worker of the pool is no trial of its arguments
            assert r.status == 400 and body["error"]["param"] == "args.model_path"
            assert "says which model the worker serves" in body["error"]["message"]

        stop, answers, failures = asyncio.Event(), [], []
        load = asyncio.create_task(_load(url, stop, answers, failures))
        # real time under load, on purpose: the canary's before share is the workers' traffic over the
        # controller's window (2 s of wall here), which only load over that much time fills; counted from
        # the load's first answers (a starved start of its clients is no part of it)
        await wait_until(lambda: len(answers) >= 48, "the load's first answers", timeout=60)
        await asyncio.sleep(3.0)
        tried = await asyncio.to_thread(
            pacer_try, url, "--worker", "w1", "--args", "max_running_requests=2", "--note", "a cap to test the canary"
        )
        assert tried.returncode == 0, tried.stderr
        assert "trial #" in tried.stdout and "on w1: max_running_requests=2" in tried.stdout
        async with s.post(url + "/admin/trial", json={"worker": "w0", "args": {"max_running_requests": 8}}) as r:
            body = await r.json()
            assert r.status == 409 and "a canary is under way on w1" in body["error"]["message"]

        async def reverted() -> Any:
            entries = (await _get(s, url + "/admin/decisions"))["decisions"]
            back = [e for e in entries if e["rule"] == "canary_revert" and e["status"] == "applied"]
            return entries if back else None

        entries = await wait_until(reverted, "the canary is reverted", timeout=90, every=0.2)
        stop.set()
        await load
        (trial,) = [e for e in entries if e["rule"] == "operator_trial"]
        assert trial["worker"] == "w1" and trial["reason"].startswith("operator trial: a cap to test the canary")
        assert trial["status"] == "applied" and trial["canary_verdict"] == "revert"
        assert trial["canary_share_after"] < 0.6 < trial["canary_share_before"]
        workers = {w["id"]: w for w in (await _get(s, url + "/admin/workers"))["workers"]}
        assert workers["w1"]["args"] == original and workers["w1"]["restarts"] == 2
        assert workers["w0"]["restarts"] == 0
    assert failures == [] and len(answers) > 100 and set(answers) == {48}


async def _ready(s: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with s.get(url + "/ready") as r:
            if r.status != 200:
                return False
        workers = (await _get(s, url + "/admin/workers"))["workers"]
        return len(workers) == 2 and all(w["state"] == "ready" for w in workers)
    except aiohttp.ClientError:
        return False
