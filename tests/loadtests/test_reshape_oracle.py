"""The reshape benchmark's parts that need no process: its oracle (every shape in virtual time), the
policies its arms run (valid, the auto arm's with ``reshape = true``), and its report's figures.
The live arms are the benchmark's to run (``python -m loadtests reshape``)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from loadtests.reshape import build_parser, oracle, policy, report
from proxy.control.shape import Shape
from proxy.policy import parse_policy


def test_the_oracle_prices_every_shape_of_8_gpus_at_the_defaults() -> None:
    truth = oracle(build_parser().parse_args([]))
    assert [str(s) for s in truth] == ["8 x tp 1", "4 x tp 2", "2 x tp 4", "1 x tp 8"]
    best = max(truth, key=truth.__getitem__)
    assert best != Shape(8, 1) and truth[best] > 1.3 * truth[Shape(8, 1)]  # the tp-8 worker is the one to leave


def test_the_arms_policies_are_valid(tmp_path: Path) -> None:
    args = build_parser().parse_args([])
    auto = parse_policy(tomllib.loads(policy(Shape(8, 1), args, auto=True, log_dir=tmp_path)))
    (pool,) = auto.pools
    assert pool.tp == 8 and pool.control.reshape and pool.engine.args["max_running_requests"] == 768
    best = parse_policy(tomllib.loads(policy(Shape(2, 4), args, auto=False, log_dir=tmp_path)))
    assert best.pools[0].engine.workers == 4 and best.pools[0].engine.args["max_running_requests"] == 192
    assert str(best.control.journal_path).startswith(str(tmp_path))


def test_the_report_compares_the_advice_and_the_auto_arm_with_the_best() -> None:
    truth = {Shape(1, 2): 100.0, Shape(2, 1): 80.0}
    arms: dict[str, Any] = {
        "best": {"tok_per_s": 100.0, "errors": 0},
        "auto": {"tok_per_s": 97.0, "errors": 0, "advice": {"best_shape": "2 x tp 1", "predicted_gain": 0.2},
                 "reshape": {"status": "applied"}},
    }  # fmt: skip
    out = report(truth, Shape(1, 2), arms)
    assert out["advice_vs_oracle_best"] == 1.0 and out["auto_vs_best"] == 0.97 and out["errors"] == 0
    assert out["reshape_status"] == "applied" and out["advice_predicted_gain"] == 0.2
