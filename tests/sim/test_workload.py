"""True output lengths, determinism, and what simulate() reports."""

from __future__ import annotations

from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate
from tests.sim.helpers import config


def _wl(n: int = 200) -> list[RequestSpec]:
    return [RequestSpec(arrival=i * 0.02, prompt_len=100 + i % 50, max_new_tokens=500) for i in range(n)]


def test_same_seed_same_result_other_seed_other_result() -> None:
    argv = ("--sim-output-fraction", "0.5", "--sim-output-spread", "0.5", "--max-total-tokens", "50000")
    a = simulate(config(*argv, "--sim-seed", "7"), _wl())
    b = simulate(config(*argv, "--sim-seed", "7"), _wl())
    c = simulate(config(*argv, "--sim-seed", "8"), _wl())
    assert a == b
    assert [r.output_tokens for r in a.requests] != [r.output_tokens for r in c.requests]


def test_requests_stop_early_by_eos() -> None:
    res = simulate(config("--sim-output-fraction", "0.1"), _wl(50))
    assert all(r.output_tokens == 50 and r.finish_reason == "stop" for r in res.requests)


def test_spread_draws_within_bounds() -> None:
    res = simulate(config("--sim-output-fraction", "0.5", "--sim-output-spread", "0.3"), _wl(300))
    outs = [r.output_tokens for r in res.requests]
    assert min(outs) >= 100 and max(outs) <= 400 and len(set(outs)) > 50


def test_explicit_output_len_and_ignore_eos() -> None:
    wl = [
        RequestSpec(prompt_len=10, max_new_tokens=100, output_len=7),
        RequestSpec(prompt_len=10, max_new_tokens=100, output_len=7, ignore_eos=True),
        RequestSpec(prompt_len=10, max_new_tokens=5, output_len=70),
    ]
    res = simulate(config(), wl)
    assert [(r.output_tokens, r.finish_reason) for r in res.requests] == [(7, "stop"), (100, "length"), (5, "length")]


def test_result_fields_and_trace() -> None:
    res = simulate(config(), _wl(100))
    assert res.finished == 100 and res.oom is None and res.rejected == 0
    assert res.output_tokens == 100 * 500
    assert res.output_tok_per_s == res.output_tokens / res.makespan_s
    assert res.trace and res.trace[-1].time == res.makespan_s
    assert {p.kind for p in res.trace} == {"prefill", "decode"}
    times = [p.time for p in res.trace]
    assert times == sorted(times)
    assert all(
        r.first_token_time is not None and r.arrival <= r.first_token_time <= r.finish_time for r in res.requests
    )


def test_time_scale_divides_all_durations() -> None:
    one = simulate(config(), _wl(20))
    ten = simulate(
        config("--sim-time-scale", "10"),
        [
            RequestSpec(arrival=s.arrival / 10, prompt_len=s.prompt_len, max_new_tokens=s.max_new_tokens)
            for s in _wl(20)
        ],
    )
    assert ten.makespan_s * 10 == __import__("pytest").approx(one.makespan_s, rel=1e-6)


def test_queue_limit_rejects() -> None:
    res = simulate(
        config("--max-queued-requests", "5", "--max-running-requests", "2"),
        [RequestSpec(prompt_len=10, max_new_tokens=10) for _ in range(20)],
    )
    # all 20 arrive before the first step: 5 wait, 15 are refused
    assert res.rejected == 15 and res.finished == 5


_SCRIPT = """
import json
from proxy.sim.cli import build_parser, resolve_config
from proxy.sim.request import RequestSpec
from proxy.sim.tokenizer import encode
from proxy.sim.virtual import simulate
cfg = resolve_config(build_parser().parse_args(
    ["--schedule-policy", "lpm", "--max-total-tokens", "12000", "--sim-output-fraction", "0.5",
     "--sim-output-spread", "0.5", "--sim-seed", "3"]))
wl = [RequestSpec(arrival=i * 0.03, prompt_ids=encode(f"system {i % 4} " * 200 + f"user {i}"), max_new_tokens=1500)
      for i in range(120)]
res = simulate(cfg, wl)
print(json.dumps([res.output_tokens, res.retractions, res.steps, round(res.makespan_s, 9),
                  [(r.output_tokens, r.cached_tokens, r.num_retractions) for r in res.requests]]))
"""


def test_deterministic_across_processes_and_hash_seeds() -> None:
    import os
    import subprocess
    import sys

    from tests.sim.helpers import ROOT

    outs = [
        subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout
    data = __import__("json").loads(outs[0].stdout)
    assert data[1] > 0 and any(c for _, c, _ in data[4])  # the run exercised retraction and the cache
