"""The benchmark's policy for ``pacer serve`` in front of external workers is a policy the proxy loads."""

from __future__ import annotations

import tomllib

from loadtests.procs import pacer_policy
from proxy.policy import EngineKind, parse_policy


def test_pacer_policy_loads_with_what_it_was_given() -> None:
    urls = ["http://127.0.0.1:30001", 'http://127.0.0.1:30002/"quoted"']
    policy = parse_policy(tomllib.loads(pacer_policy(urls, queue_band=(10, 20), headroom=3, scrape_interval_s=0.25)))
    assert policy.engine.kind == EngineKind.EXTERNAL and policy.engine.urls == tuple(urls)
    assert (policy.pacing.queue_band, policy.pacing.headroom, policy.pacing.scrape_interval_s) == ((10, 20), 3, 0.25)
    assert (policy.queue.capacity, policy.control.mode) == (100000, "off")
