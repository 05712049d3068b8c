"""Each of the twin's replays once per test run: the ``replays_once`` fixture.

A twin's prediction is a pure function of its simulator config under the args and of the replay (the
simulator is deterministic: same config, same requests, same result), and the planner's tests plan one
workload many times over: under other settings, on another look, in each parametrized case. The
fixture keeps each prediction the first replay gave, by a digest of that config and that replay,
and hands it back (with the caller's args) when the same replay comes again. Every plan still gets
the figures a replay of its own would give; only the simulator's run is not repeated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import pytest

from proxy.control.twin import Prediction, Twin
from proxy.control.workload import Observed, Replay, replay
from proxy.sim.config import SimConfigError

_SEEN: dict[bytes, Prediction] = {}


def _digest(loaded: Replay) -> bytes:
    answered = sorted(loaded.answered.items())
    what = (loaded.specs, sorted(loaded.foreground), loaded.until, answered, loaded.continues_at, loaded.start)
    return hashlib.blake2b(repr(what).encode(), digest_size=20).digest()


def _key(twin: Twin, args: Mapping[str, object], loaded: Replay) -> bytes | None:
    try:
        cfg = twin.config(args)
    except SimConfigError:
        return None  # no replay: the prediction says so at once
    return hashlib.blake2b(repr(cfg).encode() + _digest(loaded), digest_size=20).digest()


@pytest.fixture
def replays_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``Twin.predict`` replays a config and a replay once in the run; the same again gets that prediction."""
    predict = Twin.predict

    def once(self: Twin, args: Mapping[str, object], workload: Sequence[Observed] | Replay) -> Prediction:
        loaded = workload if isinstance(workload, Replay) else replay(workload)
        key = _key(self, args, loaded)
        if key is None:
            return predict(self, args, loaded)
        if key not in _SEEN:
            _SEEN[key] = predict(self, args, loaded)
        return replace(_SEEN[key], args=dict(args))

    monkeypatch.setattr(Twin, "predict", once)
    yield
