"""The controller is timed by the engine's clock: one recorded trace, replayed as a simulated worker
at time scales 1, 10 and 40 shows it (every timestamp divided by the scale, every rate the worker
reports multiplied), gets the same decisions at the same modelled times, and the same revival
back-offs in modelled seconds. No constant is scaled by the test: the controller converts them from
the clock rate it is given, as the app gives it from the worker's launch arguments.

The trace: a start-up line with memory to spare (a tuning restart), a minute of steady serving (the
restart's outcome, the planner's looks, its cool-down), then three deaths in a row (the crash
back-off and the crash loop)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from proxy.control.constants import CONSTANTS
from proxy.control.controller import Controller
from proxy.control.planner import Observed
from proxy.engines.base import Sample
from proxy.engines.sglang.engine import SGLANG, SIM
from proxy.policy import ControlMode

from .recorded import log_events
from .test_controller import ROOMY, RecordingActor, controller, info
from .test_planner_controller import Requests

RATES = (1.0, 10.0, 40.0)
STEP = 2.5  # modelled seconds between scrapes (exact in binary at every rate above: no boundary drifts)
DEATHS = (400.0, 410.0, 420.0)  # modelled seconds
END = 450.0


def _sample(modelled: float, rate: float) -> Sample:
    """A steady worker at ``modelled`` seconds: 3,000 output tokens per modelled second."""
    return Sample(time=modelled / rate, queue=300, running=200, token_usage=0.8, gen_throughput=3000.0 * rate,
                  generation_tokens_total=3000.0 * modelled, retractions_total=0.0)  # fmt: skip


def _workload(rate: float) -> list[Observed]:
    """The answers the proxy saw, on the wall clock of a worker at ``rate``."""
    return [Observed(arrived=i * 0.5 / rate, finished=(i * 0.5 + 20.0) / rate, prompt_tokens=400, output_tokens=300,
                     max_tokens=4096) for i in range(300)]  # fmt: skip


async def _replay(rate: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """What the controller decided on the trace at ``rate``, each at its modelled time; and its notes."""
    c, clock = controller(ControlMode.AUTO, None, RecordingActor(), around=Requests(_workload(rate)),
                          crash_backoff_s=(2.0, 5.0, 15.0), clock_rate=rate)  # fmt: skip
    seen: list[tuple[Any, ...]] = []
    c.track(info(args=ROOMY))
    for event in log_events("log_startup_headroom.log"):
        c.on_event("w0", dataclasses.replace(event, time=event.time / rate))
    outcomes: set[int] = set()
    steps = int(END / STEP)
    for k in range(steps + 1):
        modelled = k * STEP
        clock.now = modelled / rate
        if modelled in DEATHS:
            act = c.decide_revival("w0", 1, "exited with code 1")
            assert act is not None
            seen.append((modelled, act.decision.rule, round(act.decision.delay_s * rate, 6)))
            await c.carry_out(act)  # its back-off on the loop's virtual clock
            continue
        c.on_sample("w0", _sample(modelled, rate))
        if k % round(CONSTANTS.interval_s / STEP):
            continue  # the controller ticks every interval_s of the worker's clock
        await _tick(c, modelled, rate, seen, outcomes)
    notes = [(e["rule"], e["evidence"].get("deaths")) for e in c.journal.entries()
             if e["status"] == "noted" and e["rule"] != "planner"]  # fmt: skip
    return seen, notes


async def _tick(c: Controller, modelled: float, rate: float, seen: list[tuple[Any, ...]], outcomes: set[int]) -> None:
    for act in c.tick():
        seen.append((modelled, act.decision.rule, act.decision.changes))
        await c.carry_out(act)
    for job in c.plans_due():
        seen.append((modelled, "plan", pytest.approx(job.horizon.seconds * rate, rel=0.01)))  # rounded to 0.1 wall s
    for entry in c.journal.entries():
        verdict = (entry.get("outcome") or {}).get("verdict")
        if verdict is not None and entry["id"] not in outcomes:
            outcomes.add(entry["id"])
            seen.append((modelled, "outcome", entry["rule"], verdict))


@pytest.mark.looptime
async def test_a_simulated_worker_gets_the_same_decisions_at_the_same_modelled_times_at_any_time_scale() -> None:
    runs, notes = {}, {}
    for rate in RATES:
        runs[rate], notes[rate] = await _replay(rate)
    first = runs[RATES[0]]
    # the trace exercises the clock: a restart, its outcome a window later, plans every plan_interval_s
    # once the cool-down is over, the revivals' back-offs (the third death a crash loop on the arguments
    # that ran well: nothing to go back to, a note)
    kinds = [entry[1] for entry in first]
    assert kinds[0] == "memory_headroom" and "outcome" in kinds and kinds.count("plan") >= 3
    assert [e for e in first if e[0] in DEATHS] == [(400.0, "revive", 2.0), (410.0, "revive", 5.0),
                                                    (420.0, "revive", 15.0)]  # fmt: skip
    plans = [e[0] for e in first if e[1] == "plan"]
    assert plans[0] >= CONSTANTS.cooldown_s and all(
        b - a >= CONSTANTS.plan_interval_s for a, b in itertools.pairwise(plans)
    )
    for rate in RATES[1:]:
        assert runs[rate] == first, rate
    assert notes[RATES[0]] == [("crash_loop", 3)]
    assert all(notes[rate] == notes[RATES[0]] for rate in RATES)


def test_the_clock_rate_is_the_workers_own() -> None:
    """A simulated worker's launch arguments (or its ``extra_args``) and its server info say how fast its
    clock runs; SGLang's says nothing: the wall's."""
    assert SIM.modelled({"sim_time_scale": 10}, ()).clock_rate == 10.0
    assert SIM.modelled({}, ["--sim-time-scale", "40"]).clock_rate == 40.0
    assert SIM.modelled({}, ()).clock_rate == 1.0 and SGLANG.modelled({"model_path": "m"}, ()).clock_rate == 1.0
    info = {"internal_states": [{"sim": {"time_scale": 10.0}}]}
    assert SIM.clock_rate_from_server_info(info) == 10.0 and SGLANG.clock_rate_from_server_info(info) == 10.0
    assert SGLANG.clock_rate_from_server_info({"internal_states": [{}], "mem_fraction_static": 0.8}) is None


def test_the_constants_convert_to_the_wall_clock() -> None:
    """Durations over the rate, rates per minute times it; the rest as they are."""
    k = CONSTANTS.in_wall(40.0)
    assert (k.window_s, k.interval_s, k.plan_interval_s) == (1.5, 0.125, 1.5)
    assert k.crash_backoff_s == (0.05, 0.125, 0.375, 0.75, 1.5)
    assert k.retractions_per_min == 240.0 and k.retractions_per_1k_tokens == CONSTANTS.retractions_per_1k_tokens
    assert k.plan_requests == CONSTANTS.plan_requests and CONSTANTS.in_wall(1.0) is CONSTANTS
    with pytest.raises(ValueError):
        CONSTANTS.in_wall(0.0)


def test_an_external_workers_server_info_sets_the_rate_after_the_start(tmp_path: Any) -> None:
    c, _ = controller(ControlMode.AUTO, None)
    assert c.constants.window_s == CONSTANTS.window_s
    c.track(info())
    c.set_clock_rate(10.0)
    assert c.clock_rate == 10.0 and c.constants.window_s == 6.0 and c.window("w0").span_s == 6.0
    assert c.rules.constants.cooldown_s == 6.0
