"""The radix prefix cache, and what lpm and the counters make of it."""

from __future__ import annotations

from proxy.sim.radix import RadixCache
from proxy.sim.request import RequestSpec
from proxy.sim.tokenizer import encode
from proxy.sim.virtual import simulate
from tests.sim.helpers import config, engine, run_until


def test_match_insert_split_and_sizes() -> None:
    c = RadixCache()
    assert c.insert((1, 2, 3, 4))[0] == 4
    added, _ = c.insert((1, 2, 9, 9, 9))
    assert added == 3 and c.total_size == 7 and c.evictable_size == 7
    n, node = c.match((1, 2, 3, 7))
    assert n == 3 and node.key == (3,)  # the edge (3, 4) was split after 3
    assert c.peek((1, 2, 9, 9, 9, 9)) == 5
    assert c.total_size == 7


def test_locked_nodes_are_not_evictable_lru_goes_first() -> None:
    c = RadixCache()
    c.insert((1, 2, 3))
    _, new = c.insert((5, 6, 7))
    c.lock(new)
    assert c.evictable_size == 3
    assert c.evict(100) == 3  # only the unlocked branch
    assert c.peek((1, 2, 3)) == 0 and c.peek((5, 6, 7)) == 3
    c.unlock(new)
    c.insert((8, 9))
    c.match((5, 6, 7))  # touch: (8, 9) is now the least recently used
    assert c.evict(1) == 2 and c.peek((5, 6, 7)) == 3


def test_shared_system_prompt_is_cached_and_counted() -> None:
    logs: list[str] = []
    eng = engine("--schedule-policy", "lpm", logs=logs)
    system = " ".join(f"rule{i}" for i in range(400))
    first = eng.add(prompt_ids=encode(system + " question zero"), max_new_tokens=4, output_len=4)
    run_until(eng, lambda: first.finish_time is not None)
    second = eng.add(prompt_ids=encode(system + " another question"), max_new_tokens=4, output_len=4)
    run_until(eng, lambda: second.finish_time is not None, t=10.0)
    shared = len(encode(system))
    assert first.cached_tokens == 0
    assert second.cached_tokens >= shared
    line = [m for m in logs if m.startswith("Prefill batch")][-1]
    assert f"#cached-token: {second.cached_tokens}," in line
    assert eng.last_cache_hit_rate > 0.9


def test_disable_radix_cache_caches_nothing() -> None:
    eng = engine("--disable-radix-cache")
    ids = encode("same prompt " * 50)
    a = eng.add(prompt_ids=ids, max_new_tokens=2, output_len=2)
    run_until(eng, lambda: a.finish_time is not None)
    b = eng.add(prompt_ids=ids, max_new_tokens=2, output_len=2)
    run_until(eng, lambda: b.finish_time is not None, t=5.0)
    assert b.cached_tokens == 0 and eng.num_used_tokens == 0


def test_lpm_serves_cached_prefixes_first() -> None:
    """A cached prefix jumps the queue under lpm, not under fcfs."""
    hot = " ".join(f"doc{i}" for i in range(2000))

    def order(policy: str) -> list[str]:
        eng = engine("--schedule-policy", policy, "--max-running-requests", "1")
        warm = eng.add(prompt_ids=encode(hot + " warm"), max_new_tokens=1, output_len=1, rid="warm")
        run_until(eng, lambda: warm.finish_time is not None)
        reqs = [
            eng.add(prompt_ids=encode(f"cold{i} " * 300), max_new_tokens=1, output_len=1, rid=f"cold{i}")
            for i in range(3)
        ]
        reqs.append(eng.add(prompt_ids=encode(hot + " again"), max_new_tokens=1, output_len=1, rid="hot"))
        run_until(eng, lambda: all(r.finish_time is not None for r in reqs), t=10.0)
        return [r.rid for r in sorted(reqs, key=lambda r: r.finish_time)]

    assert order("lpm")[0] == "hot"
    assert order("fcfs")[-1] == "hot"


def test_prefix_sharing_workload_hits_in_virtual_run() -> None:
    system = encode(" ".join(f"sys{i}" for i in range(1000)))
    wl = [
        RequestSpec(arrival=i * 0.01, prompt_ids=system + encode(f"user question {i}"), max_new_tokens=32)
        for i in range(50)
    ]
    res = simulate(config("--schedule-policy", "lpm"), wl)
    assert sum(r.cached_tokens for r in res.requests) >= 45 * len(system)
