"""Pacing against fake workers in the test's own event loop: the upper edge holds and every
request completes exactly once. Proxy, workers and load share one loop (and, on a busy machine,
little CPU), so how well the queue is kept *above* the lower edge is not checked here: that is
``test_pacing_sim.py``'s job, with the proxy and the workers in their own processes."""

from __future__ import annotations

from tests.harness.fake_engine import MODEL
from tests.server.pacing_check import run_burst


async def test_burst_keeps_worker_queues_in_band(make_proxy):
    lo, hi = 10, 30
    h = await make_proxy(
        n_workers=2,
        policy={"pacing": {"queue_band": [lo, hi], "headroom": 10, "scrape_interval_s": 0.05}},
        worker={"max_running": 16, "token_delay_s": 0.005},
    )
    n = 600  # over six times what the two workers hold within the band (2 x (16 running + 30 queued))
    run = await run_burst(
        h.url,
        [w.url for w in h.workers],
        n,
        lambda i: {"model": MODEL, "max_tokens": 16, "sim_output_len": 2 + (i * 7919) % 9},
        backlog=lambda: len(h.state.admission),
    )
    assert run.statuses.count(200) == n
    assert len(set(run.ids)) == n
    assert sum(len(w.finished) for w in h.workers) == n  # none twice, none lost
    for url, samples in run.samples.items():
        assert len(samples) >= 10, url
        assert max(q for _, q, _ in samples) <= hi, samples
