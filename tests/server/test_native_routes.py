"""SGLang's own endpoints besides inference, through the proxy, in front of two real ``pacer sim``
workers: what a native client (SGLang's frontend ``RuntimeEndpoint`` reads ``/get_model_info`` as it
starts) and an operator (``/flush_cache``, ``/abort_request`` by ``rid``) call on SGLang."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.server.state import ProxyState
from proxy.workers.base import WorkerState
from tests.harness.sim_proxy import serve_sims
from tests.harness.wait import wait_until


@pytest.fixture
async def proxy(tmp_path) -> AsyncIterator[tuple[str, ProxyState]]:
    async with serve_sims(tmp_path, {"workers": 2}) as p:
        await wait_until(
            lambda: sum(w.state is WorkerState.READY for w in p.pool.workers()) == 2,
            "sum(w.state is WorkerState.READY for w in p.pool.workers()) == 2",
            timeout=60,
        )
        yield p.url, p.state


async def test_info_and_health_come_from_a_worker_as_it_answers(proxy) -> None:
    url, st = proxy
    async with aiohttp.ClientSession() as s:
        worker = st.pool.get("w0").url
        for path in ("/get_model_info", "/model_info"):
            async with s.get(url + path) as mine, s.get(worker + path) as theirs:
                assert mine.status == 200 and await mine.json() == await theirs.json()
        async with s.get(url + "/get_server_info") as r:
            info = await r.json()
        assert r.status == 200 and "internal_states" in info and info["frontend"] == "python"
        async with s.get(url + "/health_generate") as r:
            assert r.status == 200
        async with s.get(url + "/get_model_info?model=another") as r:  # one model served, and not that one
            assert r.status == 404 and "'another' does not exist" in (await r.json())["error"]["message"]
        for w in st.pool.workers():
            st.pool.set_state(w.id, WorkerState.DRAINING)
        async with s.get(url + "/health_generate") as r:  # nothing ready: the deep check says so
            body = await r.json()
        assert r.status == 503 and body["error"]["code"] == "not_ready", body
        for w in st.pool.workers():
            st.pool.set_state(w.id, WorkerState.READY)


async def test_flush_and_abort_reach_every_worker(proxy) -> None:
    url, st = proxy
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            async with s.request(method, url + "/flush_cache") as r:
                assert r.status == 200 and (await r.text()).startswith("Cache flushed.")
        # a long request under the client's rid, aborted by that rid wherever it runs
        payload = {"text": "hello", "rid": "abort-me", "sampling_params": {"max_new_tokens": 30000, "ignore_eos": True}}
        running = asyncio.ensure_future(s.post(url + "/generate", json=payload))
        await wait_until(lambda: st.board.total_in_flight() == 1, "st.board.total_in_flight() == 1", timeout=20)
        holder = next(w.id for w in st.pool.workers() if st.board.get(w.id).in_flight == 1)
        async with s.post(url + "/flush_cache") as r:  # a request runs there: SGLang's refusal, naming the worker
            refused = await r.json()
        assert r.status == 400 and f"{holder}: 400 'Cache not flushed." in refused["error"]["message"], refused
        async with s.post(url + "/abort_request", json={"rid": "abort-me"}) as r:
            assert r.status == 200
        async with await asyncio.wait_for(running, 10) as r:
            answer = await r.json()
        assert answer["meta_info"]["id"] == "abort-me" and answer["meta_info"]["finish_reason"]["type"] == "abort"
        assert answer["meta_info"]["completion_tokens"] < 30000


async def test_a_batch_of_prompts_with_sampling_params_each(proxy) -> None:
    url, _ = proxy
    payload = {
        "text": ["one", "two"],
        "sampling_params": [{"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 5, "ignore_eos": True}],
    }
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=payload) as r:
        answers = await r.json()
    assert r.status == 200, answers
    assert [a["meta_info"]["completion_tokens"] for a in answers] == [3, 5]


async def test_what_acts_on_every_caller_s_work_takes_the_admin_key(make_proxy, monkeypatch) -> None:
    """A client's key reads the model's info; an abort (SGLang's takes abort_all) or a flush, which
    reach every caller's requests, take the admin key."""
    monkeypatch.setenv("TEST_NATIVE_KEYS", "sk-user name=user")
    monkeypatch.setenv("TEST_NATIVE_ADMIN", "sk-admin")
    h = await make_proxy(policy={"auth": {"api_keys_env": "TEST_NATIVE_KEYS", "admin_key_env": "TEST_NATIVE_ADMIN"}})
    user, admin = {"Authorization": "Bearer sk-user"}, {"Authorization": "Bearer sk-admin"}
    async with aiohttp.ClientSession() as s:
        async with s.post(h.url + "/abort_request", json={"abort_all": True}, headers=user) as r:
            assert r.status == 401 and "admin key" in (await r.json())["error"]["message"]
        async with s.post(h.url + "/abort_request", json={"rid": "x"}) as r:
            assert r.status == 401
        async with s.post(h.url + "/abort_request", json={"rid": "x"}, headers=admin) as r:
            assert r.status == 200
        async with s.get(h.url + "/get_model_info") as r:
            assert r.status == 401  # no key at all
