"""The hidden perturbation flags: step time and activation memory scaled, and not reported by the server."""

from __future__ import annotations

import pytest

from proxy.sim.cli import build_parser
from proxy.sim.config import SimConfigError, resolve_config
from proxy.sim.request import RequestSpec
from proxy.sim.virtual import simulate


def _config(*flags: str):
    return resolve_config(build_parser().parse_args(["--sim-gpu", "a100-40gb", *flags]))


def test_step_time_factor_scales_the_run_and_activation_factor_the_memory_a_step_needs():
    work = [RequestSpec(prompt_len=400, max_new_tokens=300, output_len=300) for _ in range(64)]
    base = simulate(_config(), work)
    slow = simulate(_config("--sim-step-time-factor", "1.25"), work)
    assert slow.makespan_s == pytest.approx(base.makespan_s * 1.25, rel=1e-9)
    assert slow.output_tokens == base.output_tokens
    assert base.oom is None
    assert simulate(_config("--sim-activation-factor", "200"), work).oom is not None


def test_the_factors_are_hidden_and_checked():
    cfg = _config("--sim-step-time-factor", "1.2", "--sim-activation-factor", "0.8")
    assert "sim_step_time_factor" not in cfg.server_args and "sim_activation_factor" not in cfg.server_args
    with pytest.raises(SimConfigError):
        _config("--sim-step-time-factor", "0")
