"""Each pool paces with its own settings: ``[pool.pacing]`` over ``[pacing]`` for its gate, its
scrapes and its fast tier; a pool's ``[pool.control] mode`` decides whether its fast tier runs; the
fast tier of one pool never touches another pool's workers. The app is built (not served) over two
external pools and samples are published on its load board, as the scrapers do."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.compose import build_app
from proxy.engines.base import Sample
from proxy.errors import ApiError
from proxy.policy import parse_policy
from proxy.request import relay
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerState
from proxy.workers.fleet import build_pool


def two_pools(**b_extra: Any) -> dict[str, Any]:
    return {
        "pacing": {"queue_band": [4, 64], "headroom": 8, "scrape_interval_s": 0.2},
        "control": {"mode": "auto"},
        "proxy": {"gpu_sample_interval_s": 0},
        "pool": [
            {"name": "a", "model": "ma", "kind": "external", "urls": ["http://127.0.0.1:9"]},
            {"name": "b", "model": "mb", "kind": "external", "urls": ["http://127.0.0.1:10"], **b_extra},
        ],
    }


def test_a_pool_pacing_table_overrides_pacing_keys_for_that_pool_only() -> None:
    p = parse_policy(two_pools(pacing={"queue_band": [100, 400], "headroom": 50}), "<t>")
    a, b = p.pools
    assert (a.pacing.queue_band, a.pacing.headroom) == ((4, 64), 8)
    assert (b.pacing.queue_band, b.pacing.headroom, b.pacing.scrape_interval_s) == ((100, 400), 50, 0.2)
    assert p.pacing.queue_band == (4, 64)
    one = parse_policy({"pacing": {"headroom": 3}}, "<t>")
    assert one.pools[0].pacing is one.pacing  # the [engine] shorthand paces with [pacing]


@pytest.mark.parametrize(
    ("pacing", "key"),
    [({"queue_band": [9, 1]}, "pool[b].pacing.queue_band"), ({"headrom": 1}, "pool[b].pacing.headrom")],
)
def test_a_bad_pool_pacing_key_is_refused_naming_it(pacing: dict[str, Any], key: str) -> None:
    with pytest.raises(Exception) as info:
        parse_policy(two_pools(pacing=pacing), "<t>")
    assert getattr(info.value, "key", None) == key


def sample(t: float) -> Sample:
    return Sample(time=t, running=3, queue=0, token_usage=0.1)


@contextlib.asynccontextmanager
async def built(doc: dict[str, Any]) -> AsyncIterator[ProxyState]:
    """The app's state over the policy's (started) external pools; their URLs answer nothing."""
    policy = parse_policy(doc, "<t>")
    pool = build_pool(policy, {})
    app = build_app(policy, pool, manage_pool=False, gpu_sampler=lambda: [])
    await pool.start()
    try:
        yield app[PROXY]
    finally:
        await pool.stop()


async def test_each_pool_gates_and_paces_with_its_own_band() -> None:
    async with built(two_pools(pacing={"queue_band": [100, 400], "headroom": 50})) as st:
        assert st.requests.dispatcher_of("a").band.target == 12 and st.requests.dispatcher_of("b").band.target == 150
        st.board.publish("a-w0", sample(1.0), None)
        assert st.board.get("a-w0").queue_target == 12 and st.board.get("b-w0").queue_target is None
        st.board.publish("b-w0", sample(1.0), None)
        assert st.board.get("b-w0").queue_target == 150  # its own band's target, not the first pool's
        assert st.board.get("a-w0").queue_target == 12


async def test_a_pool_with_control_off_has_no_fast_tier() -> None:
    async with built(two_pools(control={"mode": "off"})) as st:
        assert st.control_mode() == "a auto, b off"  # as /admin/decisions and the dashboard say it
        st.board.publish("a-w0", sample(1.0), None)
        st.board.publish("b-w0", sample(1.0), None)
        assert st.board.get("a-w0").queue_target == 12 and st.board.get("b-w0").queue_target is None


async def test_each_pool_s_fast_tier_keeps_its_own_policy_timings() -> None:
    """The fast tier's timings come from the pool: its workers' clock (the controller's back-off hold,
    5 s of the engine's clock: 1 s for a simulated worker five times faster), and so does the hold of the
    batch's caps beside interactive work (5 engine seconds, the dispatcher's window too). Retractions that keep rising back pool b's worker off again after its 1 s hold, pool
    a's not within its 5 s."""
    doc = two_pools()
    b_pool = {k: v for k, v in doc["pool"][1].items() if k != "urls"}
    doc["pool"][1] = {**b_pool, "kind": "sim", "extra_args": ["--sim-time-scale", "5"]}
    async with built(doc) as st:
        assert (st.requests.dispatcher_of("a").clock_rate, st.requests.dispatcher_of("b").clock_rate) == (1.0, 5.0)

        def retracting(t: float, retracted: float, running: int) -> Sample:
            return Sample(time=t, running=running, queue=4, token_usage=0.9, retractions_total=retracted)

        limits: dict[str, list[int | None]] = {"a-w0": [], "b-w0": []}
        # the worker down to each limit by the next look (a back-off bites before the next one)
        for t, retracted, running in ((1.0, 0.0, 50), (2.0, 10.0, 50), (3.5, 20.0, 39), (5.0, 30.0, 30)):
            for worker in limits:
                st.board.publish(worker, retracting(t, retracted, running), None)
                limits[worker].append(st.board.get(worker).limit)
        assert limits["a-w0"] == [None, 43, 43, 43]  # 0.8 x 54 held, then held for 5 s
        assert limits["b-w0"] == [None, 43, 34, 27]  # again after each 1 s hold


async def test_a_queue_timeout_names_the_workers_of_the_request_s_own_pool() -> None:
    """A model whose workers are all down: the 503 says so with their causes, not the other pool's
    ready workers' pacing."""
    async with built(two_pools()) as st:
        for w in st.pool.workers():
            assert w.state is WorkerState.DOWN  # nothing answers at their URLs
        message = relay._no_worker_message(st.requests, st.requests.dispatcher_of("b"))
        assert message.startswith("no worker is ready (b-w0 down); the request waited 300 s")
        assert "a-w0" not in message and "127.0.0.1" not in message  # its own pool; no host told a client


async def test_each_pool_s_requests_are_counted_under_its_name() -> None:
    """A fleet's operator tells which model's requests fail or wait: the request path's series and the
    queue depth carry the pool; the door's refusals (before a pool is chosen) do not."""
    async with built(two_pools()) as st:
        assert st.requests.metrics_for("mb") is st.metrics.of("b")
        assert st.requests.metrics_for("ma") is st.metrics.of("a")
        for model, status in (("mc", 404), (None, 400)):  # no pool is the default of another's requests
            with pytest.raises(ApiError) as refused:
                st.requests.metrics_for(model)
            assert refused.value.status == status and "ma, mb" in refused.value.message
        st.metrics.of("b").fail_timeout.inc()
        st.metrics.of("b").completed.inc()
        text = st.metrics.render().decode()
    assert 'pacer_requests_failed_total{pool="b",reason="queue_timeout"} 1.0' in text
    assert (
        'pacer_requests_completed_total{pool="b"} 1.0' in text
        and 'pacer_requests_completed_total{pool="a"} 0.0' in text
    )
    assert (
        'pacer_queue_depth{pool="a",priority="batch"} 0.0' in text
        and 'pacer_queue_depth{pool="b",priority="batch"}' in text
    )


async def test_ready_names_the_pools_with_no_worker_ready() -> None:
    """One model's workers all down: the proxy is still ready (the other model serves), and /ready's
    body says which model's pool is not serving."""
    import orjson
    from aiohttp.test_utils import make_mocked_request

    from proxy.server import handlers
    from tests.harness.fake_engine import FakeEngine

    engine = FakeEngine()
    url = await engine.start()
    doc = two_pools()
    doc["pool"][0]["urls"] = [url]  # a answers; b's URL answers nothing
    policy = parse_policy(doc, "<t>")
    pool = build_pool(policy, {})
    app = build_app(policy, pool, manage_pool=False, gpu_sampler=lambda: [])
    await pool.start()
    try:
        answer = await handlers.ready(make_mocked_request("GET", "/ready", app=app))
    finally:
        await pool.stop()
        await engine.stop()
    assert answer.status == 200
    assert orjson.loads(answer.body) == {
        "status": "ready",
        "ready_workers": 1,
        "workers": 2,
        "pools_not_serving": ["b"],
    }
