"""Golden digests: the simulator's deterministic output for fixed seeds and configs.

Each case steps the engine in virtual time over a fixed workload (with aborts) and hashes every
step's kind and duration, the load figures the metrics endpoint exports, the log lines and the
per-request results; a second hash covers :func:`~proxy.sim.virtual.simulate`. A refactor that
keeps these digests produces the same simulation, byte for byte.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from proxy.sim.engine import Engine, QueueFull
from proxy.sim.request import Req, RequestSpec
from proxy.sim.virtual import simulate
from tests.sim.helpers import config

SHARED = tuple(range(1, 401))  # a common system prompt: the radix cache and lpm see it


def _prompt(rng: random.Random, i: int) -> tuple[int, ...]:
    own = tuple(range(-(i + 1) * 100_000, -(i + 1) * 100_000 + rng.randrange(20, 1500)))
    return SHARED + own if i % 3 else own


def _workload(seed: int, n: int) -> list[tuple[float, tuple[int, ...], int, bool]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(40.0)
        out.append((t, _prompt(rng, i), rng.choice((64, 256, 1024, 5000)), rng.random() < 0.2))
    return out


def _engine_digest(argv: tuple[str, ...], seed: int, n: int) -> str:
    h = hashlib.sha256()
    eng = Engine(config(*argv), log=lambda level, msg: h.update(f"{level} {msg}\n".encode()))
    wl = _workload(seed, n)
    reqs: list[Req] = []
    t, i, steps = 0.0, 0, 0
    while steps < 40_000:
        while i < len(wl) and wl[i][0] <= t:
            arrival, ids, max_new, ign = wl[i]
            try:
                reqs.append(eng.add(prompt_ids=ids, max_new_tokens=max_new, ignore_eos=ign, now=max(t, arrival)))
            except QueueFull:
                h.update(b"queue full\n")
            i += 1
        if steps % 97 == 50 and reqs:
            victim = reqs[(steps * 7) % len(reqs)]
            h.update(f"abort {eng.abort(victim)}\n".encode())
        step = eng.plan(t)
        if step is None:
            if i >= len(wl):
                break
            t = wl[i][0]
            continue
        h.update(
            repr(
                (
                    step.kind,
                    step.duration,
                    step.batch_size,
                    step.cuda_graph,
                    step.oom,
                    step.need_mib,
                    [(it.req.rid, it.take, it.prefix_len, it.last, it.hit, it.new) for it in step.items],
                )
            ).encode()
        )
        if step.oom is not None:
            break
        t += step.duration
        out = eng.complete(step, t)
        steps += 1
        h.update(
            repr(
                (
                    out.kind,
                    [r.rid for r in out.started],
                    [r.rid for r in out.finished],
                    out.decoded,
                    eng.n_run,
                    len(eng.waiting),
                    eng.waiting_tokens,
                    eng.token_usage,
                    eng.num_used_tokens,
                    eng.available,
                    eng.cache.evictable_size,
                    eng.ratio,
                    eng.last_gen_throughput,
                    eng.last_cache_hit_rate,
                    eng.kv_tokens_running,
                    eng.last_cuda_graph,
                    eng.last_retracted,
                    eng.retracted_total,
                    eng.retracted_input_tokens,
                    eng.retracted_output_tokens,
                    eng.generated_tokens,
                    eng.decode_steps,
                    eng.last_decode_log_time,
                    eng.running_reservation(),
                    eng.batch_is_full,
                )
            ).encode()
        )
    for r in reqs:
        h.update(
            repr(
                (
                    r.rid,
                    r.arrival,
                    r.first_token_time,
                    r.finish_time,
                    eng.output_len(r),
                    r.cached_tokens,
                    r.num_retractions,
                    r.finish_reason,
                )
            ).encode()
        )
    h.update(f"flush {eng.flush_cache()}".encode())
    return h.hexdigest()


def _simulate_digest(argv: tuple[str, ...], seed: int, n: int) -> str:
    h = hashlib.sha256()
    specs = [
        RequestSpec(arrival=a, prompt_len=len(ids), prompt_ids=ids, max_new_tokens=m, ignore_eos=ign)
        for a, ids, m, ign in _workload(seed, n)
    ]
    res = simulate(config(*argv), specs, log=lambda level, msg: h.update(f"{level} {msg}\n".encode()))
    h.update(repr(res).encode())
    return h.hexdigest()


CASES = [
    pytest.param(
        (
            "--sim-seed",
            "1",
            "--max-total-tokens",
            "60000",
            "--sim-output-fraction",
            "0.6",
            "--sim-output-spread",
            "0.5",
        ),
        1,
        300,
        id="retracting-lpm",
    ),
    pytest.param(
        (
            "--sim-seed",
            "2",
            "--max-total-tokens",
            "200000",
            "--schedule-policy",
            "fcfs",
            "--chunked-prefill-size",
            "512",
            "--decode-log-interval",
            "7",
        ),
        2,
        250,
        id="chunked-fcfs",
    ),
    pytest.param(
        (
            "--sim-seed",
            "3",
            "--max-total-tokens",
            "40000",
            "--disable-radix-cache",
            "--max-running-requests",
            "48",
            "--max-queued-requests",
            "60",
        ),
        3,
        250,
        id="no-cache-queue-cap",
    ),
    pytest.param(
        (
            "--sim-seed",
            "4",
            "--max-total-tokens",
            "80000",
            "--schedule-policy",
            "lof",
            "--schedule-conservativeness",
            "0.5",
        ),
        4,
        200,
        id="lof-conservative",
    ),
    pytest.param(
        ("--sim-seed", "5", "--max-total-tokens", "80000", "--schedule-policy", "random"), 5, 200, id="random"
    ),
]

GOLDEN: dict[str, tuple[str, str]] = {  # (engine steps, simulate())
    "retracting-lpm": (
        "8eb2037bfb0c12a430ebd123820e20d6a9a48195bdece0640660ca131b9609cf",
        "07b60c850e405e6b09ba9334a945ef8081ff9a632edc381eef9f77d26e631a52",
    ),
    "chunked-fcfs": (
        "cf5833f4eb2552400b2beef9f20f499c76e877a25aa63007b015f27d8ba9ad2b",
        "714bd295e53d405732e9668c4b0a487dd4aff0e40cdf48830ede5b437a673016",
    ),
    "no-cache-queue-cap": (
        "84cbcc648a1993998c20b6e026c295c951e09d93c6ad54323eb1cdf7277a01e8",
        "a9b45979c1fd4eedfcde048d81600162624990640045b70c693defad03d2c0e8",
    ),
    "lof-conservative": (
        "b972ab85ec3e27ad879c3b4057b4d94b88a15e079d9b2e0c3f15e4de3ca2d38d",
        "be08b19a5861aab3ff07abdb5936852c2eac48daf6450965bf52a522e31d1a4f",
    ),
    "random": (
        "c55d29e8e1919586ebf2bd00a63694c3060c7906bdfd2d08df2d275b6eda4554",
        "6af0fcc917cc845cc79bf37275288e6169e4ec67742613a4b3708d47b18b00a4",
    ),
}


@pytest.mark.parametrize(("argv", "seed", "n"), CASES)
def test_digest_unchanged(request: pytest.FixtureRequest, argv: tuple[str, ...], seed: int, n: int) -> None:
    key = request.node.callspec.id
    got = (_engine_digest(argv, seed, n), _simulate_digest(argv, seed, n))
    assert got == GOLDEN[key]
