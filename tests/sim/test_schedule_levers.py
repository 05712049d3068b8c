"""The simulator's side of the guide's levers: lpm's scheduling round, its in-batch deduplication, the
CUDA graphs' captured sizes, and a proxy's gate in front of a virtual-time run."""

from __future__ import annotations

import pytest

from proxy.sim.request import RequestSpec
from proxy.sim.steptime import LPM_PER_REQ_S, LPM_PER_TOKEN_S, graph_batch_sizes, lpm_round_seconds
from proxy.sim.virtual import SimResult, simulate
from tests.sim.helpers import config, engine, unique_prompt


def test_an_lpm_round_costs_its_matching_and_fcfs_none() -> None:
    """Three uncached prompts waiting: lpm walks each one's cached prefix (none) and, in the queue's own
    tree, its whole prompt; the round's CPU time is added to the step it schedules."""
    prompts = [unique_prompt(1000, k) for k in range(3)]
    durations = {}
    for policy in ("lpm", "fcfs"):
        eng = engine("--schedule-policy", policy, "--max-total-tokens", "100000")
        for ids in prompts:
            eng.add(prompt_ids=ids, max_new_tokens=8, now=0.0)
        step = eng.plan(0.0)
        assert step is not None and step.kind == "prefill"
        durations[policy] = step.duration
    assert lpm_round_seconds(3, 3000) == pytest.approx(3 * LPM_PER_REQ_S + 3000 * LPM_PER_TOKEN_S)
    assert durations["lpm"] - durations["fcfs"] == pytest.approx(lpm_round_seconds(3, 3000))


def test_lpm_sends_one_of_a_shared_uncached_head_first_and_the_rest_after() -> None:
    """SGLang's in-batch prefix caching: of requests whose common head is not cached yet, the first in
    the queue goes first and the others go last (admitted only where the round's budget reaches them),
    so the head is computed once; a request of its own is not held back. A chunk of 500 tokens takes
    two of the three: lpm the first and the one of its own, fcfs the two that share the head."""
    head = unique_prompt(200, 1)
    queue = [head + unique_prompt(50, 2), head + unique_prompt(50, 3), unique_prompt(250, 4)]
    admitted = {}
    for policy in ("lpm", "fcfs"):
        eng = engine("--schedule-policy", policy, "--max-total-tokens", "100000", "--chunked-prefill-size", "500")
        reqs = [eng.add(prompt_ids=ids, max_new_tokens=8, now=0.0) for ids in queue]
        step = eng.plan(0.0)
        assert step is not None
        admitted[policy] = [reqs.index(it.req) for it in step.items]
    assert admitted == {"lpm": [0, 2], "fcfs": [0, 1]}


def test_graphs_are_captured_at_sglangs_batch_sizes() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 12, *range(16, 257, 8)]
    assert graph_batch_sizes(512)[-3:] == [480, 496, 512] and len(graph_batch_sizes(512)) == 52
    assert graph_batch_sizes(160)[-1] == 160 and graph_batch_sizes(0) == []


def test_the_default_graphs_follow_the_gpu_and_tensor_parallelism() -> None:
    assert config("--sim-gpu", "h100-80gb").cuda_graph_max_bs_decode == 256
    assert config("--sim-gpu", "h100-80gb", "--tp-size", "4").cuda_graph_max_bs_decode == 512
    # more graphs reserve more of the memory fraction's default: a smaller pool
    small = config("--sim-gpu", "a100-40gb")
    large = config("--sim-gpu", "a100-40gb", "--cuda-graph-max-bs-decode", "512")
    assert small.cuda_graph_max_bs_decode == 32 and large.max_total_num_tokens < small.max_total_num_tokens


def test_a_gate_in_front_of_a_virtual_run_holds_the_queue_and_counts_waiting_from_arrival() -> None:
    cfg = config("--max-total-tokens", "30000", "--max-running-requests", "4")
    specs = [RequestSpec(arrival=0.0, prompt_len=500, max_new_tokens=64, output_len=64) for _ in range(40)]
    free = simulate(cfg, specs)
    gated = simulate(cfg, specs, queue_cap=3, gate_period_s=0.5)
    assert max(p.queue for p in free.trace) > 30 and max(p.queue for p in gated.trace) <= 3
    assert gated.finished == free.finished == 40
    assert all(r.arrival == 0.0 for r in gated.requests)  # waited outside since they arrived
    assert gated.makespan_s >= free.makespan_s


def _shared_heads(pool: str, running: str) -> tuple[SimResult, SimResult]:
    """480 requests over twelve shared heads of 2,000 tokens, interleaved, behind a gate: in arrival
    order, and in the proxy's order where the engine runs lpm."""
    cfg = config("--max-total-tokens", pool, "--max-running-requests", running, "--schedule-policy", "lpm")
    specs = [
        RequestSpec(prompt_len=2100, shared=((i * 5) % 12 + 1, 2000), max_new_tokens=64, output_len=8 + (i * 37) % 57)
        for i in range(480)
    ]
    fifo = simulate(cfg, specs, queue_cap=8, gate_period_s=0.05)
    grouped = simulate(cfg, specs, queue_cap=8, gate_period_s=0.05, prefix_first=128)
    assert fifo.finished == grouped.finished == 480
    return fifo, grouped


def _cached(run: SimResult) -> int:
    return sum(r.cached_tokens for r in run.requests)


def test_a_gate_that_sorts_by_prefix_keeps_the_running_heads_cached_where_the_pool_cannot_hold_all() -> None:
    fifo, grouped = _shared_heads("20000", "16")  # ten heads' room, less what runs
    assert _cached(grouped) > 1.1 * _cached(fifo)
    assert grouped.makespan_s < 0.95 * fifo.makespan_s


def test_a_gate_that_sorts_by_prefix_changes_nothing_where_the_pool_holds_every_head() -> None:
    fifo, grouped = _shared_heads("60000", "32")
    assert _cached(grouped) == _cached(fifo)
    assert grouped.makespan_s == pytest.approx(fifo.makespan_s, rel=0.01)
