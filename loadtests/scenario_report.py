"""A scenario's report: the figures its arms are judged on, and its markdown table.

A scenario is judged on throughput (a backlog) or, with ``judged_on = "answer_time"`` (arrivals the
best arguments keep up with), on each arm's mean modelled seconds from a request's arrival to its
answer (an arm that failed or lost a request scores nothing there); ``adaptive_over_best_static``
and ``adaptive_over_default`` are ratios of that figure (higher is better: the other arm's mean over
the adaptive's). A phased workload is also judged phase by phase, and a shift of phases against the
per-phase oracle (``adaptive_over_phase_oracle``). A fleet's report adds ``min_serving_fraction``
(the least share of the workers READY in any sample of an arm under control), the injected trial as
the journal tells it (``injection``: the canary's verdict and figures, when it was reverted) and
``revert_cost`` (1 - the injected arm's throughput over the adaptive arm's). The report also carries
each arm's decisions journal and time series, and the oracle's sweep.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.phase_oracle import adaptive_over_phase_oracle
from loadtests.scenario_arm import TRIAL_ARM, ArmResult
from loadtests.scenario_defs import Phases, Scenario
from loadtests.scenario_proxy import arm_control, control_hash, shipped_control

__all__ = ["interactive_ttft", "scenario_report", "table"]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def scenario_report(
    sc: Scenario,
    results: Mapping[str, ArmResult],
    *,
    bound: Mapping[str, Any] | None,
    alone_p99: float | None,
    sweep_info: Mapping[str, Any],
    control: Mapping[str, Any] | None,
    workdir: Path,
) -> dict[str, Any]:
    """The report of a scenario's arms (``results``): the judged ratios, the twin's errors and the plans'
    gains from the adaptive arm's journal, the phases', the interactive class's and a fleet's figures,
    what ``[control]`` the adaptive arm ran (``control``: None, the shipped one), and each arm's own
    figures, journal and series. ``bound``: :func:`~loadtests.scenarios.restart_bound`'s replay;
    ``alone_p99``: the interactive class's p99 time to first token with no batch running;
    ``sweep_info``: the oracle's sweep; ``workdir``: where the arms ran."""
    tps = {a: r.judged(sc.judged_on) for a, r in results.items()}  # the judged figure (higher is better)
    throughput = {a: r.output_tok_per_s for a, r in results.items()}
    decisions = results["adaptive"].decisions if "adaptive" in results else []
    errors = [float(d["prediction_error"]) for d in decisions if isinstance(d.get("prediction_error"), (int, float))]
    answers = [float(d["answer_error"]) for d in decisions if isinstance(d.get("answer_error"), (int, float))]
    # plans that did not pay: the twin's prediction for the args the worker ran, against what it measured
    twin_errors = [
        float(d["current_prediction_error"]) for d in decisions
        if isinstance(d.get("current_prediction_error"), (int, float))
    ]  # fmt: skip
    # each checked plan's gain: predicted, measured on the requests served under its args (against the twin
    # under the old args on them), and the first window's, after over before (mostly the restart's refill)
    names = {"predicted": "predicted_gain", "measured": "measured_gain", "first_window": "first_window_gain"}
    gains = [{key: d.get(name) for key, name in names.items()} for d in decisions if "gain_requests" in d]
    return {
        "lost": sum(r.requests_lost for r in results.values()),
        "adaptive_over_best_static": _ratio(tps.get("adaptive", 0.0), tps.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(tps) else None,
        "adaptive_over_default": _ratio(tps.get("adaptive", 0.0), tps.get("default", 0.0)) if {"adaptive", "default"} <= set(tps) else None,
        "adaptive_over_sglang_defaults": _ratio(tps.get("adaptive", 0.0), tps.get("defaults", 0.0)) if {"adaptive", "defaults"} <= set(tps) else None,
        "judged_on": sc.judged_on,
        "sim_slowdown": {a: None if r.sim_slowdown is None else round(r.sim_slowdown, 3) for a, r in results.items()},
        "throughput_over_best_static": _ratio(throughput.get("adaptive", 0.0), throughput.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(throughput) else None,
        "mean_answer_s": {a: None if (m := r.mean_answer_s) is None else round(m, 2) for a, r in results.items()},
        "prediction_error_median": round(statistics.median(errors or twin_errors), 4) if errors or twin_errors else None,
        "prediction_error_basis": "acted plans" if errors else "plans not acted on (current args)" if twin_errors else None,
        # acted plans checked on the requests served under their args (the twin out of sample)
        "plans_checked": len(errors),
        # acted plans on the throughput basis: the twin's mean answer time against the worker's, on the same requests
        "answer_error_median": round(statistics.median(answers), 4) if answers else None,
        "plan_gains": gains,
        # the twin on the requests it replayed under the args the worker ran (in sample, every plan not acted on)
        "twin_error_median": round(statistics.median(twin_errors), 4) if twin_errors else None,
        "plans_noted": len(twin_errors),
        "restarts": results["adaptive"].restarts if "adaptive" in results else None,
        "phases": (phases := _phase_figures(sc, results)),
        **_phase_judged(phases),
        "interactive_ttft_p99_s": (ttft := interactive_ttft(sc, results)),
        "interactive_ttft_p99_alone_s": alone_p99,
        "interactive_ttft_over_alone": _ratio(ttft["adaptive"], alone_p99) if alone_p99 and ttft and "adaptive" in ttft else None,
        **(_fleet_figures(sc, results) if sc.workers > 1 else {}),
        "scenario": sc.name,
        "premise": sc.premise,
        "gpu": sc.gpu,
        "model": sc.model,
        "time_scale": sc.time_scale,
        "workload": sc.workload.describe(),
        # the [control] the adaptive arm ran with, and whether it is the shipped policy's unchanged
        "control": (ran := arm_control("auto", control)),
        "control_hash": control_hash(ran),
        "shipped_control_hash": control_hash(shipped := shipped_control()),
        "control_is_shipped": ran == shipped,
        "phase_oracle": sweep_info.get("phase_oracle"),
        **_phase_oracle_judged(phases, sweep_info),
        "arms": {a: r.summary() for a, r in results.items()},
        "adaptive_over_oracle": _ratio(tps.get("adaptive", 0.0), tps.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(tps) else None,
        "oracle_sweep": sweep_info,
        "restart_bound": bound,
        "decisions": {a: r.decisions for a, r in results.items() if r.decisions},
        "series": {a: r.series for a, r in results.items()},
        "completions": {a: r.completions for a, r in results.items()},
        # each streamed request's arrival and time to its first text (modelled seconds), in arrival order
        "first_tokens": {a: [[round(r.arrivals[i] * sc.time_scale, 2), round(r.ttfts[i] * sc.time_scale, 3)]
                             for i in sorted(r.ttfts, key=r.arrivals.__getitem__)]
                         for a, r in results.items() if r.ttfts},
        "workdir": str(workdir),
    }  # fmt: skip


def _phase_oracle_judged(phases: list[dict[str, Any]] | None, sweep_info: Mapping[str, Any]) -> dict[str, Any]:
    """The adaptive arm against the per-phase oracle (:mod:`loadtests.phase_oracle`): the ratio (None
    where there is none: not a shift of phases, no live oracle arm, or a sweep kept from before it)."""
    judged = adaptive_over_phase_oracle(phases, sweep_info.get("phase_oracle"))
    return {
        "adaptive_over_phase_oracle": None if judged is None else judged["ratio"],
        "phase_oracle_ratios": None if judged is None else judged["phase_ratios"],
    }


def _fleet_figures(sc: Scenario, results: Mapping[str, ArmResult]) -> dict[str, Any]:
    """A fleet's figures: the least share of its workers serving (READY) in any sample of an arm
    under control, and the operator's injected trial: what the canary judged, when it was
    reverted, and its cost (1 - the injected arm's throughput over the adaptive arm's)."""
    controlled = {a: r.min_serving_fraction for a, r in results.items() if r.control_mode == "auto"}
    seen = [v for v in controlled.values() if v is not None]
    out: dict[str, Any] = {
        "min_serving_fraction": min(seen) if seen else None,
        "min_serving_fraction_by_arm": {a: r.min_serving_fraction for a, r in results.items()},
        "workers": sc.workers,
        "worker_args": [dict(a) for a in sc.worker_args],
        "best_static_basis": f"all {sc.workers} workers with the sweep's best arguments for one worker's share "
        "of the trace (the oracle arm)",
    }
    injected, adaptive = results.get(TRIAL_ARM), results.get("adaptive")
    if injected is None:
        return out
    out["revert_cost"] = (
        round(1.0 - injected.output_tok_per_s / adaptive.output_tok_per_s, 4)
        if adaptive is not None and adaptive.output_tok_per_s > 0
        else None
    )
    out["injection"] = _injection(sc, injected)
    return out


def _injection(sc: Scenario, r: ArmResult) -> dict[str, Any]:
    """The injected trial as the journal tells it: its entry, the canary's verdict and figures, and the
    revert (modelled seconds from the trial to the worker serving with its own arguments again)."""
    assert sc.trial is not None
    sent = r.trial or {}
    entry_id = (sent.get("answer") or {}).get("entry") if sent.get("status") == 202 else None
    out: dict[str, Any] = {"worker": sc.trial.worker, "args": dict(sc.trial.args), "at_modelled_s": sc.trial.at_s,
                           "sent": sent}  # fmt: skip
    entry = next((d for d in r.decisions if d.get("id") == entry_id), None)
    if entry is None:
        return out
    out.update(
        entry=entry_id,
        status=entry.get("status"),
        canary_verdict=entry.get("canary_verdict"),
        canary_share_before=entry.get("canary_share_before"),
        canary_share_after=entry.get("canary_share_after"),
    )
    revert = next((d for d in r.decisions if d.get("rule") == "canary_revert" and d.get("worker") == sc.trial.worker
                   and int(d.get("id", 0)) > int(entry["id"])), None)  # fmt: skip
    if revert is not None:
        out.update(revert_entry=revert.get("id"), revert_status=revert.get("status"),
                   reverted_after_modelled_s=round((float(revert["monotonic"]) - float(entry["monotonic"]))
                                                   * sc.time_scale, 1))  # fmt: skip
    return out


def _phase_figures(sc: Scenario, results: Mapping[str, ArmResult]) -> list[dict[str, Any]] | None:
    """Per phase of a phased workload and per arm: mean and p99 time from arrival to answer (modelled
    seconds) and output tokens per modelled second from the phase's first arrival to its last answer.
    A phase that arrives over time is judged on its time to answer; a batch on its throughput."""
    if not isinstance(sc.workload, Phases):
        return None
    phase_of, arrivals, outputs = sc.workload.phase_of(), sc.workload.arrivals(), [r[2] for r in sc.workload.requests()]
    out = []
    for k, part in enumerate(sc.workload.parts):
        idx = [i for i, p in enumerate(phase_of) if p == k]
        judged = "throughput" if part.rate is None else "time to first token (p99)" if part.stream else "queue time"
        row: dict[str, Any] = {"phase": k, "judged_on": judged}
        for arm, r in results.items():
            lat = sorted(r.latencies[i] * sc.time_scale for i in idx if i in r.latencies)
            if not lat:
                continue
            first = min(arrivals[i] for i in idx)
            last = max(arrivals[i] + r.latencies[i] * sc.time_scale for i in idx if i in r.latencies)
            tokens = sum(outputs[i] for i in idx if i in r.latencies)
            row[arm] = {"mean_s": round(sum(lat) / len(lat), 2), "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 2),
                        "tok_per_s": round(tokens / (last - first), 1) if last > first else None}  # fmt: skip
            ttft = sorted(r.ttfts[i] * sc.time_scale for i in idx if i in r.ttfts)
            if ttft:
                row[arm].update(ttft_mean_s=round(sum(ttft) / len(ttft), 3),
                                ttft_p99_s=round(ttft[int(0.99 * (len(ttft) - 1))], 3))  # fmt: skip
        out.append(row)
    return out


STATIC_ARMS = ("default", "oracle", "defaults")


def interactive_ttft(sc: Scenario, results: Mapping[str, ArmResult]) -> dict[str, float] | None:
    """Per arm, the p99 time to first token (modelled seconds) of the requests sent as ``interactive``."""
    idx = [i for i, (priority, _) in enumerate(sc.workload.classes()) if priority == "interactive"]
    out = {}
    for arm, r in results.items():
        ttft = sorted(r.ttfts[i] * sc.time_scale for i in idx if i in r.ttfts)
        if ttft:
            out[arm] = round(ttft[int(0.99 * (len(ttft) - 1))], 3)
    return out or None


def _phase_judged(phases: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A phased run judged phase by phase: against each static arm, the adaptive arm's ratio per phase
    (its throughput over the arm's for a batch; the arm's mean time to answer over its own for
    arrivals over time, or its p99 time to first token for streamed ones: above 1 is better) and their geometric mean; the best static arm is
    the one the adaptive arm does worst against. Only the static arms that ran are compared (the
    sweep's best is chosen on the whole run's throughput, not on this)."""
    if not phases:
        return {}
    by_arm: dict[str, list[float]] = {}
    for row in phases:
        mine = row.get("adaptive")
        if not isinstance(mine, dict):
            return {}
        for arm in STATIC_ARMS:
            other = row.get(arm)
            if not isinstance(other, dict):
                continue
            if row["judged_on"] == "throughput":
                a, b = mine.get("tok_per_s"), other.get("tok_per_s")
            elif row["judged_on"].startswith("time to first token"):
                a, b = other.get("ttft_p99_s"), mine.get("ttft_p99_s")
            else:
                a, b = other.get("mean_s"), mine.get("mean_s")
            if a and b:
                by_arm.setdefault(arm, []).append(a / b)
    scores = {arm: (statistics.geometric_mean(r), r) for arm, r in by_arm.items() if len(r) == len(phases)}
    if not scores:
        return {}
    worst = min(scores, key=lambda arm: scores[arm][0])
    return {
        "adaptive_over_best_static_by_phase": round(scores[worst][0], 4),
        "best_static_by_phase": worst,
        "phase_ratios": {arm: [round(x, 4) for x in r] for arm, (_, r) in scores.items()},
    }


def _opt3(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def _control_label(rep: Mapping[str, Any]) -> str:
    """The adaptive arm's [control]: as shipped, or another (its hash)."""
    if "control_is_shipped" not in rep:
        return "-"
    return "shipped" if rep["control_is_shipped"] else f"not shipped ({rep.get('control_hash')})"


def _opt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _load(value: Any) -> str:
    return "-" if not value else f"{value[0]:.1f}-{value[1]:.1f}"


def _wait(arm: Mapping[str, Any]) -> str:
    """The role whose threads waited longest for a CPU, and that share of the arm's time."""
    waits = {role: fig["cpu_wait"] for role, fig in (arm.get("cpu") or {}).items()}
    if not waits:
        return "-"
    role = max(waits, key=waits.__getitem__)
    return f"{role} {waits[role]:.0%}"


def _rss(arm: Mapping[str, Any]) -> str:
    proxy, planner = arm.get("proxy_peak_rss_mb"), arm.get("planner_peak_rss_mb")
    return f"{proxy or '-'}" + ("" if planner is None else f" (+ {planner})")


def table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One markdown table: a row per scenario and arm."""
    head = (
        "| scenario | arm | output tok/s | mean answer s | ok | failed | lost | retractions | restarts | OOM crashes | "
        "sim slowdown | load avg | most CPU wait | proxy peak RSS MB (+ planner's process) | args at the end |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"
    )
    rows = [head]
    for rep in reports:
        for arm, a in rep["arms"].items():
            final = ", ".join(f"{k}={v}" for k, v in sorted(a["final_args"].items())) or "(SGLang defaults)"
            rows.append(f"| {rep['scenario']} | {arm} | {a['output_tok_per_s']:.0f} | {_opt(a.get('mean_answer_s'))} | {a['requests_ok']} | "
                        f"{a['requests_failed']} | {a['requests_lost']} | {a['retractions']} | {a['restarts']} | "
                        f"{a['oom_crashes']} | {_opt(a.get('sim_slowdown'))} | {_load(a.get('load_avg'))} | {_wait(a)} | "
                        f"{_rss(a)} | {final} |")  # fmt: skip
    ratios = [
        "",
        "| scenario | judged on | adaptive / oracle | adaptive / default | replay: oracle args from the adaptive's restart "
        "(or first look) | replay: adaptive's final args from then | modelled s of the restart (or look) "
        "| replay: oracle args from 0 s | replay: no restart, the best of the proxy's own levers "
        "| adaptive / per-phase oracle "
        "| control |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rep in reports:
        ao, ad = rep.get("adaptive_over_oracle"), rep.get("adaptive_over_default")
        b = rep.get("restart_bound") or {}
        ratios.append(
            f"| {rep['scenario']} | {rep.get('judged_on', 'throughput')} | {'-' if ao is None else f'{ao:.3f}'} | "
            f"{'- (default delivered nothing)' if ad is None and 'default' in rep['arms'] else '-' if ad is None else f'{ad:.3f}'} | "
            f"{b.get('oracle_args_restarted', '-')} | {b.get('adaptive_final_args_restarted', '-')} | {b.get('restart_at_modelled_s', '-')} | "
            f"{b.get('oracle_args_restarted_at_0', '-')} | {b.get('no_restart_best', '-')} | {_opt3(rep.get('adaptive_over_phase_oracle'))} | {_control_label(rep)} |"
        )
    return "\n".join(rows + ratios)
