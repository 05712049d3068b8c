"""A plan's first looks: fewer answers than the batch the worker runs at once say little of its pace,
so the twin is not judged on them and no restart is taken on them, and they do not hold back the
looks that follow."""

from __future__ import annotations

from dataclasses import replace

from proxy.control.planner import Looks, PlanSettings, RestartCost, Twin, plan, replay
from proxy.sim.virtual import simulate

from .test_planner import GPU, MODEL, _workload

ARGS = {"schedule_conservativeness": 1.0}


def _answered(n: int) -> list:
    """A backlog of short answers under a large max_tokens (a restart to a lower conservativeness pays),
    answered by a worker as the twin models it."""
    wl = _workload(n, 1000.0, (120, 500), 4096)
    ends = {r.rid: r.finish_time for r in simulate(Twin(GPU, MODEL).config(ARGS), list(replay(wl).specs)).requests}
    ordered = sorted(wl, key=lambda o: o.arrived)
    return [replace(o, finished=o.arrived + (ends[f"s{i}"] or 0.0)) for i, o in enumerate(ordered)]


def test_a_plan_on_fewer_answers_than_requests_open_is_undecided_and_leaves_no_error() -> None:
    answered = _answered(300)
    cost, twin = RestartCost(startup_s=30.0), Twin(GPU, MODEL)
    read = plan(twin, ARGS, answered, cost, PlanSettings())
    assert read.worth and read.current_error is not None
    early = plan(twin, ARGS, answered, cost, PlanSettings(peak_running=400))  # it ran more at once than it answered
    assert early.predicted_gain >= 0.03 and not early.worth and early.undecided
    assert early.current_error is None and "answered 300 requests against a batch of 400" in early.reason
    assert plan(twin, ARGS, answered, cost, PlanSettings(peak_running=300)).worth
    # it neither counts nor resets the looks that say a restart pays, and leaves the twin's error unread
    looks = Looks().after(read).after(early)
    assert looks.paying == 1 and looks.errors == (read.current_error,)
