"""Controller scenarios: ``python -m loadtests scenario NAME|all [--report FILE.json] [--arms default,adaptive,oracle]``

Each scenario (:mod:`loadtests.scenario_defs`) runs its arms on the simulated engine, one after the
other, each a real ``pacer serve`` process in front of ``pacer sim`` workers (the arms and what each
counts: :mod:`loadtests.scenario_arm`), and writes a JSON report, its markdown table (``FILE.md``)
and a plot (``FILE.png``) (what the report says: :mod:`loadtests.scenario_report`). The ``oracle``
arm runs the best static arguments of a sweep in virtual time (:mod:`loadtests.oracle`), each trial
scored on the figure the arms are judged on; ``--sweep FILE`` keeps the sweep (deterministic in the
scenario) between runs. A shift of phases (``shift``, ``shift-perturbed``) is also judged against
the per-phase oracle (:mod:`loadtests.phase_oracle`, built from the same sweep).

A fleet scenario (``workers`` > 1) runs that many workers in one pool, each with the scenario's
arguments and its own ``worker_args`` over them in the arms that run the operator's arguments; the
oracle's sweep runs on one worker's share of the trace and its best arguments go to every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.oracle import (
    LEVER_VALUES,
    PacedResult,
    Pacing,
    Restart,
    SearchSpace,
    prefix_limit,
    sim_config,
    simulate_paced,
    sweep,
)
from loadtests.phase_oracle import Replay, phase_oracle
from loadtests.scenario_arm import ALL_ARMS, ALONE_ARM, ARM_KEYS, ARMS, TRIAL_ARM, ArmResult, run_arm
from loadtests.scenario_defs import SCENARIOS, Phases, Scenario
from loadtests.scenario_proxy import PACING, SHIPPED_POLICY, control_hash, policy_toml, shipped_control
from loadtests.scenario_report import interactive_ttft, scenario_report, table
from proxy.request.pacing import Band
from proxy.sim.request import RequestSpec
from proxy.sim.twin import running_cap

__all__ = [
    "ALL_ARMS",
    "ARMS",
    "ARM_KEYS",
    "SHIPPED_POLICY",
    "TRIAL_ARM",
    "ArmResult",
    "control_hash",
    "main",
    "phase_replay",
    "policy_toml",
    "replayed",
    "run_arm",
    "run_scenario",
    "shipped_control",
    "swept",
]

# -- a scenario -------------------------------------------------------------------------------------


def scenario_pacing(sc: Scenario) -> Pacing:
    """The arms' pacing gate (:data:`PACING`, the policy's default headroom) in the sweep's engine seconds."""
    from proxy.policy import PacingSettings

    lo, hi = PACING["queue_band"]
    return Pacing.of(Band(lo=lo, hi=hi, headroom=PacingSettings().headroom), PACING["scrape_interval_s"], sc.time_scale)


def oracle_args(sc: Scenario) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep's best static arguments, and the sweep itself for the report. Every trial feeds the
    engine through the arms' own pacing gate (:func:`scenario_pacing`) as the requests arrive: the
    arrival the arms see; each trial is scored on the figure the arms are judged on (``judged_on``)."""
    t = time.process_time()
    pacing = scenario_pacing(sc)
    # a fleet: one worker's share of the trace (every n-th request), its best arguments for all n
    specs = sc.workload.specs()[:: sc.workers]
    result = sweep(
        sc.start_args,
        specs,
        gpu=sc.gpu,
        model=sc.model,
        space=SearchSpace(
            min_available_gb=sc.min_available_gb,
            pacing=pacing,
            objective=sc.judged_on,
            schedule_policy=LEVER_VALUES["schedule_policy"],
            cuda_graph_max_bs_decode=LEVER_VALUES["cuda_graph_max_bs_decode"],
        ),
        perturb=sc.perturb_args(),
    )
    best = {k: v for k, v in result.best.args.items() if v is not None}
    info: dict[str, Any] = {
        "best": result.best.as_dict(),
        "start": result.start.as_dict(),
        "trials": len(result.trials),
        "cpu_s": round(time.process_time() - t, 1),
        "pacing": {"target": pacing.target, "scrape_s": pacing.scrape_s},
        "objective": sc.judged_on,
        "swept_on": "the whole trace"
        if sc.workers == 1
        else f"every {sc.workers}th request (one worker's share), the best for all {sc.workers} workers",
        "note": "modelled seconds (time scale 1), the engine fed through the proxy's pacing gate (arrivals over "
        "time: fed as they arrive); scored on "
        + ("1 / mean time from arrival to answer" if sc.judged_on == "answer_time" else "output tokens per second")
        + f"; OOM or a start-up failure scores 0; free memory at start-up >= {sc.min_available_gb:g} GB",
    }
    if isinstance(sc.workload, Phases) and sc.workers == 1:
        info["phase_oracle"] = phase_oracle(sc.workload, result.trials, result.best, phase_replay(sc))
        info["cpu_s"] = round(time.process_time() - t, 1)
    return best, info


def replayed(
    sc: Scenario, args: Mapping[str, Any], requests: Sequence[RequestSpec], hold: int | None = None
) -> PacedResult:
    """``requests`` replayed on one fresh engine of the scenario's under ``args``, fed through the arms'
    pacing gate (``hold``: holding the worker's open requests at that many), in virtual time."""
    config = sim_config(args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args())
    return simulate_paced(config, requests, scenario_pacing(sc), hold=hold)


def phase_replay(sc: Scenario) -> Replay:
    """:func:`replayed` as the per-phase oracle reads it: per request, modelled seconds from arrival to answer."""
    return lambda args, requests: replayed(sc, args, requests).answer_s


def swept(sc: Scenario, sweep_path: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The oracle's sweep (:func:`oracle_args`): read from ``sweep_path`` when it exists, else run (and
    written there when given). The sweep is deterministic in the scenario; an hour's trace costs
    minutes of CPU per sweep."""
    if sweep_path is not None and Path(sweep_path).exists():
        saved = json.loads(Path(sweep_path).read_text())
        if saved.get("scenario") != sc.name:
            raise ValueError(f"{sweep_path} holds the sweep of {saved.get('scenario')!r}, not {sc.name!r}")
        return saved["args"], saved["sweep"]
    best, info = oracle_args(sc)
    if sweep_path is not None:
        Path(sweep_path).write_text(json.dumps({"scenario": sc.name, "args": best, "sweep": info}))
    return best, info


def restart_bound(sc: Scenario, adaptive: ArmResult, oracle: Mapping[str, Any]) -> dict[str, Any] | None:
    """What one restart at the adaptive arm's own moment costs, replayed in virtual time: the oracle's
    arguments and the adaptive arm's final ones, each switched to at that moment (the worker's start-up
    paid, its unfinished work taken back) and each run static from the start, as fractions of the
    oracle's static replay. ``oracle_args_restarted`` is the best any controller acting at that moment
    could have done; the live arm adds what the replay leaves out (scrapes, drain, CPU). An arm that did
    not restart is priced at its planner's first look (``restart_at``): the earliest it could have.
    Beside them, the bounds of any controller: the oracle's arguments restarted to at 0 s, and (an arm
    that did not restart) the proxy's own levers at its arguments (``no_restart_best``)."""
    # a restart carried out has its act recorded (the arguments set before the first launch have none)
    applied = [
        d for d in adaptive.decisions if d.get("status") == "applied" and d.get("action") == "restart" and "act" in d
    ]
    looks = [d for d in adaptive.decisions if d.get("rule") == "planner"]
    moment = applied[0] if applied else looks[0] if looks else None
    if moment is None or not adaptive.started:
        return None
    at_s = max(0.0, (float(moment["monotonic"]) - adaptive.started) * sc.time_scale)
    pacing, specs = scenario_pacing(sc), sc.workload.specs()
    start = sim_config(sc.start_args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args())
    static: dict[str, float] = {}
    moved: dict[str, float] = {}
    for name, args in (("oracle_args", oracle), ("adaptive_final_args", adaptive.final_args)):
        cfg = sim_config(
            args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args()
        )  # time scale 1: its start-up is the modelled one
        static[name] = _replay_score(sc, simulate_paced(cfg, specs, pacing))
        restart = Restart(at_s=at_s, config=cfg, startup_s=cfg.startup_wall_seconds)
        moved[name] = _replay_score(sc, simulate_paced(start, specs, pacing, restart))
        if name == "oracle_args":  # the earliest any controller could: before the first request is served
            at_zero = dataclasses.replace(restart, at_s=0.0)
            moved["oracle_args_at_0"] = _replay_score(sc, simulate_paced(start, specs, pacing, at_zero))
    base = static["oracle_args"]
    if base <= 0:
        return None
    out: dict[str, Any] = {"restart_at_modelled_s": round(at_s, 1), "restarts_live": adaptive.restarts,
                           "restart_at": "its restart" if applied else "its first look"}  # fmt: skip
    for name in static:
        out[f"{name}_restarted"] = round(moved[name] / base, 3)
        out[f"{name}_static"] = round(static[name] / base, 3)
    out["oracle_args_restarted_at_0"] = round(moved["oracle_args_at_0"] / base, 3)
    if not applied:
        out["no_restart_best"] = round(
            max(static["adaptive_final_args"], _own_levers(sc, adaptive.final_args)) / base, 3
        )
    return out


def _own_levers(sc: Scenario, args: Mapping[str, Any]) -> float:
    """The best the controller's levers that need no restart make of a worker started with ``args``,
    replayed in virtual time: the hold at its CUDA graphs' batch and, for an lpm worker, its queue past
    the prefix limit, each alone and both (0 where neither applies)."""
    cfg = sim_config(args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args())
    holds = [cfg.cuda_graph_max_bs_decode] if 0 < cfg.cuda_graph_max_bs_decode < running_cap(cfg) else []
    sides = [True] if prefix_limit(cfg) is not None else []
    pacing, specs = scenario_pacing(sc), sc.workload.specs()
    moves = [(h, False) for h in holds] + [(None, p) for p in sides] + [(h, p) for h in holds for p in sides]
    return max((_replay_score(sc, simulate_paced(cfg, specs, pacing, hold=h, queue_past=p)) for h, p in moves),
               default=0.0)  # fmt: skip


def _replay_score(sc: Scenario, res: PacedResult) -> float:
    """A replay scored as the arms are judged (higher is better; 0 when it died)."""
    if res.oom is not None:
        return 0.0
    if sc.judged_on == "answer_time":
        return 1.0 / res.mean_answer_s if res.mean_answer_s > 0 else 0.0
    return res.output_tok_per_s


def run_scenario(
    sc: Scenario,
    report_path: Path,
    *,
    arms: Sequence[str] = ARMS,
    workdir: Path | None = None,
    max_run_s: float = 900.0,
    oracle: Mapping[str, Any] | None = None,
    sweep_path: Path | None = None,
    control: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the arms, write ``report_path`` (JSON), its ``.md`` table and ``.png`` plot; return the report.
    ``sweep_path``: the oracle's sweep is read from there when it exists, else run and written there.
    ``control``: the ``[control]`` keys every arm runs (each with its own mode); None, what a
    benchmark runs: the shipped policy's, unchanged (the report's ``control_is_shipped``)."""
    from loadtests.plot import plot_scenario

    report_path = Path(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"pacer-scenario-{sc.name}-"))
    sweep_info: dict[str, Any] = {}
    if "oracle" in arms:
        if oracle is None:
            best, sweep_info = swept(sc, sweep_path)
        else:
            best, sweep_info = dict(oracle), {"best": {"args": dict(oracle)}, "note": "given"}
    results: dict[str, ArmResult] = {}
    for arm in arms:
        if arm == ALONE_ARM:  # run after the others (_alone_ttft), outside the arms compared
            continue
        own: Sequence[Mapping[str, Any]] = sc.worker_args  # the operator's arguments: each worker's own too
        trial = None
        if arm == "default":
            args, mode = dict(sc.start_args), "off"
        elif arm == "adaptive":
            args, mode = dict(sc.start_args), "auto"
        elif arm == TRIAL_ARM:  # the adaptive arm with the operator's trial injected
            if sc.trial is None:
                continue
            args, mode, trial = dict(sc.start_args), "auto", sc.trial
        elif arm == "oracle":
            args, mode, own = best, "off", ()
        elif arm == "defaults":  # SGLang's own defaults, no control
            args, mode, own = {}, "off", ()
        else:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ALL_ARMS)}")
        print(f"[{sc.name}] {arm}: args {args}, worker args {list(own)}, control {mode}", file=sys.stderr, flush=True)
        r = asyncio.run(run_arm(sc, arm, args, mode, base / arm, max_run_s=max_run_s, worker_args=own, trial=trial,
                                control=control))  # fmt: skip
        print(f"[{sc.name}] {arm}: {r.output_tok_per_s:.0f} tok/s, ok {r.requests_ok}, failed {r.requests_failed}, "
              f"lost {r.requests_lost}, retractions {r.retractions}, restarts {r.restarts}, OOM {r.oom_crashes}, "
              f"{r.duration_s:.1f} s, sim slowdown {r.sim_slowdown if r.sim_slowdown is None else round(r.sim_slowdown, 2)}, "
              f"load {r.load_avg[0]:.1f} -> {r.load_avg[1]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
        results[arm] = r
    alone_p99 = _alone_ttft(sc, base, max_run_s, control) if ALONE_ARM in arms else None
    bound = (
        restart_bound(sc, results["adaptive"], best)
        if {"adaptive", "oracle"} <= set(results) and sc.workers == 1
        else None
    )
    report = scenario_report(
        sc, results, bound=bound, alone_p99=alone_p99, sweep_info=sweep_info, control=control, workdir=base
    )
    report_path.write_text(json.dumps(report, indent=1))
    report_path.with_suffix(".md").write_text(table([report]) + "\n")
    plot_scenario(report, report_path.with_suffix(".png"))
    return report


def _alone_ttft(sc: Scenario, base: Path, max_run_s: float, control: Mapping[str, Any] | None) -> float | None:
    """The p99 time to first token (modelled seconds) of the interactive class with no batch running: the
    adaptive arm on the workload's interactive parts alone (None: the workload is not of both classes)."""
    parts = sc.workload.parts if isinstance(sc.workload, Phases) else (sc.workload,)
    chat = tuple(p for p in parts if p.priority == "interactive")
    if not chat or len(chat) == len(parts):
        return None
    alone = dataclasses.replace(sc, workload=Phases(parts=chat))
    print(f"[{sc.name}] {ALONE_ARM}: the interactive parts only, control auto", file=sys.stderr, flush=True)
    r = asyncio.run(run_arm(alone, ALONE_ARM, dict(sc.start_args), "auto", base / ALONE_ARM, max_run_s=max_run_s,
                            worker_args=sc.worker_args, trial=None, control=control))  # fmt: skip
    return (interactive_ttft(alone, {ALONE_ARM: r}) or {}).get(ALONE_ARM)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests scenario", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[*SCENARIOS, "all"])
    p.add_argument("--report", default=None, help="JSON report (default: scenario-NAME.json); .md and .png beside it")
    p.add_argument("--arms", default=",".join(ALL_ARMS), help="comma-separated subset of " + ",".join(ALL_ARMS)
                   + f" ({TRIAL_ARM}: scenarios with an operator trial only)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="keep each arm's policy, logs and journal here")
    p.add_argument("--max-run-s", type=float, default=900.0, help="give up on an arm after this long")
    p.add_argument(
        "--sweep",
        default=None,
        help="the oracle's sweep: read from this JSON file if it exists, else run and written there",
    )
    ns = p.parse_args(argv)
    arms = [a.strip() for a in ns.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ALL_ARMS]
    if bad:
        p.error(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ALL_ARMS)}")
    names = list(SCENARIOS) if ns.name == "all" else [ns.name]
    report = Path(ns.report or f"scenario-{ns.name}.json")
    reports = []
    for name in names:
        path = report if len(names) == 1 else report.with_name(f"{report.stem}-{name}.json")
        work = Path(ns.workdir) / name if ns.workdir else None
        sweep_path = (
            None
            if ns.sweep is None
            else Path(ns.sweep)
            if len(names) == 1
            else Path(ns.sweep).with_name(f"{Path(ns.sweep).stem}-{name}.json")
        )
        reports.append(
            run_scenario(SCENARIOS[name], path, arms=arms, workdir=work, max_run_s=ns.max_run_s, sweep_path=sweep_path)
        )
    if len(names) > 1:
        report.write_text(
            json.dumps(
                {
                    "scenarios": {
                        r["scenario"]: {
                            k: r[k]
                            for k in (
                                "arms",
                                "adaptive_over_oracle",
                                "adaptive_over_default",
                                "adaptive_over_phase_oracle",
                                "control_hash",
                                "control_is_shipped",
                            )
                        }
                        for r in reports
                    }
                },
                indent=1,
            )
        )
        report.with_suffix(".md").write_text(table(reports) + "\n")
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
