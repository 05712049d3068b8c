"""The canary's verdict on throughput per running request."""

from __future__ import annotations

from proxy.control.canary import CanaryVerdict, judge, per_load


def test_per_load_and_the_verdict():
    assert per_load(1000.0, 100.0) == 10.0
    assert per_load(None, 100.0) is None and per_load(1000.0, 0.0) is None
    assert judge(10.5, [10.0, 10.0], 0.03) is CanaryVerdict.PROMOTE
    assert judge(10.2, [10.0, None], 0.03) is CanaryVerdict.REVERT  # within the margin: not worth rolling out
    assert judge(None, [10.0], 0.03) is CanaryVerdict.WAIT
    assert judge(12.0, [None], 0.03) is CanaryVerdict.WAIT
