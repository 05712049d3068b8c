"""new_token_ratio: init, floor, decay, reset and the value set after a retraction."""

from __future__ import annotations

import pytest

from proxy.sim.ratio import RatioSchedule, ratio_after_retract
from tests.sim.helpers import engine, run_until, unique_prompt


def test_conservativeness_one() -> None:
    s = RatioSchedule.from_conservativeness(1.0)
    assert s.init == pytest.approx(0.7)
    assert s.floor == pytest.approx(0.098)
    assert s.decay == pytest.approx((0.7 - 0.098) / 600)
    r = s.init
    for _ in range(599):
        r = s.decayed(r)
    assert r > s.floor
    r = s.decayed(r)
    assert r == pytest.approx(0.098)
    assert s.decayed(r) == pytest.approx(0.098)


@pytest.mark.parametrize(("c", "init"), [(0.3, 0.21), (1.3, 0.91), (2.0, 1.0)])
def test_init_scales_with_conservativeness(c: float, init: float) -> None:
    s = RatioSchedule.from_conservativeness(c)
    assert s.init == pytest.approx(init)
    assert s.floor == pytest.approx(init * 0.14)


def test_ratio_after_retract_formula() -> None:
    # (decoded + 20 x n) / (sum max_new + 1), capped at 1
    assert ratio_after_retract(100, 2, 1000) == pytest.approx(140 / 1001)
    assert ratio_after_retract(5000, 10, 1000) == 1.0


def test_engine_decays_per_decode_step_and_resets_when_idle() -> None:
    eng = engine("--max-total-tokens", "100000")
    eng.add(prompt_ids=unique_prompt(10, 0), max_new_tokens=50, output_len=50)
    t = run_until(eng, lambda: eng.decode_steps == 10)
    assert eng.ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    run_until(eng, lambda: False, t)  # to idle
    assert eng.plan(1e6) is None
    assert eng.ratio == pytest.approx(0.7)
