"""Each worker's phase: the moves the table allows, and the phases a worker passes through as the pool
announces it, the controller acts on it, and it dies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.control.decision import ControlState
from proxy.control.phase import MOVES, Phase, PhaseError, Tracked
from proxy.control.window import Window
from proxy.policy import ControlMode
from proxy.workers.base import WorkerState

from .test_activations_fit import _startup_text
from .test_controller import RecordingActor, controller, info


def _tracked(phase: Phase) -> Tracked:
    return Tracked(state=ControlState.initial("w0", {}), window=Window(span_s=10.0), reader=None, managed=True,
                   phase=phase)  # fmt: skip


def test_every_phase_has_its_moves_and_a_move_not_listed_is_refused() -> None:
    assert set(MOVES) == set(Phase)
    for start in Phase:
        for to in Phase:
            w = _tracked(start)
            if to in MOVES[start]:
                w.move(to)
                assert w.phase is to
            else:
                with pytest.raises(PhaseError):
                    w.move(to)
                assert w.phase is start


def test_a_plan_done_returns_a_planning_worker_to_serving_and_leaves_any_other_as_it_is() -> None:
    for start in Phase:
        w = _tracked(start)
        w.plan_done()
        assert w.phase is (Phase.SERVING if start is Phase.PLANNING else start)


def test_serving_is_up_and_not_acting() -> None:
    assert {p for p in Phase if p.serving} == {Phase.SERVING, Phase.PLANNING}


def test_a_revival_goes_down_acting_serving(tmp_path: Path) -> None:
    c, clock = controller(ControlMode.AUTO, tmp_path, RecordingActor())
    c.track(info(state=WorkerState.STARTING))
    assert c.phase("w0") is Phase.DOWN
    c.track(info())
    assert c.phase("w0") is Phase.SERVING and c.state("w0").started_at == 0.0
    clock.now = 5.0
    act = c.decide_revival("w0")
    assert act is not None and c.phase("w0") is Phase.ACTING
    with pytest.raises(PhaseError):
        c._workers["w0"].move(Phase.PLANNING)  # no plan while it is being restarted
    asyncio.run(c.carry_out(act))
    assert c.phase("w0") is Phase.SERVING and c.state("w0").started_at == 5.0


def test_a_held_worker_serves_once_up_draining_and_one_gone_before_it_came_up_is_down() -> None:
    args = {"chunked_prefill_size": 16384, "mem_fraction_static": 0.9}
    for then, phase in ((WorkerState.DRAINING, Phase.SERVING), (WorkerState.DOWN, Phase.DOWN)):
        c, _clock = controller(ControlMode.AUTO, None, available_mem_band_gb=(2.0, 10.0), twin_gpu="l40s-48gb",
                               revive=False)  # fmt: skip
        c.track(info(state=WorkerState.STARTING, args=args))
        c.on_line("w0", _startup_text("l40s-48gb", "llama-3.1-8b", args))
        assert c.phase("w0") is Phase.HELD
        c.track(info(state=then, args=args))
        assert c.phase("w0") is phase
