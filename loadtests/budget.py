"""The output budget's latency: ``python -m loadtests budget [--report FILE.json] [--rounds N]``

One simulated SGLang worker (A100-40GB, Llama-3.1-8B, time scale 4) behind a real ``pacer serve``
run by the shipped policy (``policies/default.toml``'s ``[pacing]`` and ``[control]``); only the
arm's ``[control]`` differs:

* ``budget``: the shipped ``[control]`` as written (the output budget on, the default);
* ``no-budget``: the same with ``output_budget = false`` (the rest of the fast tier as shipped);
* ``off``: control off (pacing only).

The arms take turns within one run, their order rotating every round (each pair in both orders
over two rounds), on two workloads of streamed chat (``max_tokens`` 4,096, the same requests in
every arm, :data:`WORKLOADS`): ``bursty``, answers 120-500 tokens arriving in clumps near the
worker's capacity (time to first token, p50 and p99, and the end-to-end times); ``mix``, the same
chat arriving evenly with one answer in 200 long (1,000-3,000 tokens: past any budget the short
answers give, so each is continued), where the long answers' end-to-end p99 and the throughput
(output tokens per second, first arrival to last answer) are read. Medians over the rounds and
their ratios; each arm says how long its processes waited for a CPU and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.loadgen import percentile
from loadtests.scenario_arm import ArmResult, run_arm
from loadtests.scenario_defs import Phases, Scenario, Workload
from loadtests.scenario_proxy import SHIPPED_POLICY, shipped_control, shipped_pacing

__all__ = ["ARMS", "WORKLOADS", "aggregate", "arm_control", "arm_figures", "long_answers", "main", "table", "workloads"]

ARMS = ("budget", "no-budget", "off")
_START_ARGS = {"schedule_conservativeness": 1.0}  # the shipped policy's [engine] args
_CHAT = {"max_tokens": 4096, "stream": True}
LONG_SHARE = 0.005  # the mix's share of long answers: rarer than the budget's quantile reads (1 in 100)


def workloads(
    count: int = 2000, rate: float = 7.0, time_scale: float = 4.0, prompt_len: tuple[int, int] = (200, 600)
) -> dict[str, Scenario]:
    """The two workloads, ``count`` requests at ``rate`` per modelled second with prompts of
    ``prompt_len`` tokens, the worker ``time_scale`` times faster than modelled. At 7 per second these
    prompts and answers are near what the worker serves with control off (docs/benchmarks.md); a
    faster time scale measures a shared 2-core machine's CPU more than the design."""
    chat: dict[str, Any] = {**_CHAT, "prompt_len": prompt_len}
    bursty = Workload(count=count, output_len=(120, 500), rate=rate, shape=0.3, seed=51, **chat)
    n_long = max(1, round(count * LONG_SHARE))
    mix = Phases(parts=(
        Workload(count=count - n_long, output_len=(120, 500), rate=rate * (1 - LONG_SHARE), seed=52, **chat),
        Workload(count=n_long, output_len=(1000, 3000), rate=rate * LONG_SHARE, seed=53, **chat),
    ))  # fmt: skip
    common: dict[str, Any] = {"start_args": _START_ARGS, "gpu": "a100-40gb", "time_scale": time_scale}
    return {
        "bursty": Scenario(name="budget-bursty", premise="chat in clumps near capacity, answers far below max_tokens",
                           workload=bursty, **common),
        "mix": Scenario(name="budget-mix", premise="chat near capacity, one answer in 200 long: past the budget",
                        workload=mix, **common),
    }  # fmt: skip


WORKLOADS: Mapping[str, Scenario] = workloads()


def arm_control(arm: str) -> tuple[str, dict[str, Any]]:
    """The arm's control mode and ``[control]`` table: the shipped one, the budget or control off."""
    shipped = shipped_control()
    if arm == "budget":
        return str(shipped.get("mode", "auto")), shipped
    if arm == "no-budget":
        return str(shipped.get("mode", "auto")), {**shipped, "output_budget": False}
    if arm == "off":
        return "off", shipped
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def long_answers(sc: Scenario) -> list[int]:
    """The requests of the workload's long phase (its last part, when it has more than one)."""
    if not isinstance(sc.workload, Phases) or len(sc.workload.parts) < 2:
        return []
    return [i for i, phase in enumerate(sc.workload.phase_of()) if phase == len(sc.workload.parts) - 1]


def _q(values: Sequence[float], q: float, scale: float = 1.0, nd: int = 1) -> float | None:
    return round(percentile(list(values), q) * scale, nd) if values else None


def arm_figures(sc: Scenario, res: ArmResult) -> dict[str, Any]:
    """One arm of one round: first tokens (ms) and answers (s) as the client timed them (wall clock),
    the long answers' end to end and after their first token, throughput, and what the machine did."""
    long = set(long_answers(sc))
    ttft = list(res.ttfts.values())
    e2e = list(res.latencies.values())
    long_e2e = [res.latencies[i] for i in long if i in res.latencies]
    long_after = [res.latencies[i] - res.ttfts[i] for i in long if i in res.latencies and i in res.ttfts]
    return {
        "ttft_p50_ms": _q(ttft, 50, 1000), "ttft_p99_ms": _q(ttft, 99, 1000),
        "e2e_p50_s": _q(e2e, 50, nd=3), "e2e_p99_s": _q(e2e, 99, nd=3),
        "long_e2e_p50_s": _q(long_e2e, 50, nd=3), "long_e2e_p99_s": _q(long_e2e, 99, nd=3),
        "long_after_first_p99_s": _q(long_after, 99, nd=3), "long_answered": len(long_e2e),
        "last_answer_s": round(res.last_answer_s, 2), "output_tok_per_s": round(res.output_tok_per_s, 1),
        "requests_ok": res.requests_ok, "requests_failed": res.requests_failed, "requests_lost": res.requests_lost,
        "continuations": res.continuations, "output_budgets": res.output_budgets, "restarts": res.restarts,
        "retractions": res.retractions, "sim_slowdown": None if res.sim_slowdown is None else round(res.sim_slowdown, 3),
        "load_avg": [round(x, 2) for x in res.load_avg], "cpu": res.cpu,
        "limits": sorted({p["limit"] for p in res.series if p.get("limit") is not None}),
    }  # fmt: skip


_HEADLINE = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_s", "e2e_p99_s", "long_e2e_p99_s", "long_after_first_p99_s",
             "last_answer_s", "output_tok_per_s", "sim_slowdown")  # fmt: skip


def aggregate(rounds: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Per arm the median of each headline figure over the rounds; the budget arm's over each other
    arm's (medians' ratios), and the most any process on the path (client, proxy, workers) waited
    for a CPU in any round."""
    arms = [a for a in ARMS if all(a in r for r in rounds)]
    medians: dict[str, dict[str, float | None]] = {}
    for arm in arms:
        medians[arm] = {}
        for key in _HEADLINE:
            values = [r[arm][key] for r in rounds if r[arm].get(key) is not None]
            medians[arm][key] = round(statistics.median(values), 3) if values else None
    ratios: dict[str, dict[str, float | None]] = {}
    if "budget" in medians:
        for other in (a for a in arms if a != "budget"):
            ratios[f"budget/{other}"] = {
                k: round(b / o, 3) if (b := medians["budget"][k]) is not None and (o := medians[other][k]) else None
                for k in _HEADLINE
            }
    waits = [(role, fig["cpu_wait"]) for r in rounds for arm in arms for role, fig in r[arm]["cpu"].items()
             if role != "planner"]  # the planner runs in the idle class: it waits by design  # fmt: skip
    worst = max(waits, key=lambda w: w[1], default=None)
    loads = [x for r in rounds for arm in arms for x in r[arm]["load_avg"]]
    return {"medians": medians, "ratios": ratios, "cpu_wait_max": worst,
            "load_avg_range": [min(loads), max(loads)] if loads else None}  # fmt: skip


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:,.3f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def table(report: Mapping[str, Any]) -> str:
    """The report's medians and ratios as markdown, one table per workload."""
    lines: list[str] = []
    for name, w in report["workloads"].items():
        agg = w["summary"]
        cols = [k for k in _HEADLINE if any(m.get(k) is not None for m in agg["medians"].values())]
        lines += [f"**{name}** ({w['rounds_run']} rounds; most CPU wait {agg['cpu_wait_max']}, "
                  f"load {agg['load_avg_range']})", "", "| arm | " + " | ".join(cols) + " |",
                  "|---|" + "---:|" * len(cols)]  # fmt: skip
        for arm, m in agg["medians"].items():
            lines.append(f"| {arm} | " + " | ".join(_fmt(m[k]) for k in cols) + " |")
        for pair, r in agg["ratios"].items():
            lines.append(f"| {pair} | " + " | ".join(_fmt(r[k]) for k in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _say(sc: Scenario, rnd: int, arm: str, f: Mapping[str, Any]) -> None:
    cpu = ", ".join(f"{role} {fig['cpu_wait']:.0%}" for role, fig in f["cpu"].items())
    print(f"[{sc.name}] round {rnd + 1} {arm}: TTFT p50 {f['ttft_p50_ms']} ms p99 {f['ttft_p99_ms']} ms, e2e p50 "
          f"{f['e2e_p50_s']} s p99 {f['e2e_p99_s']} s, long e2e p99 {f['long_e2e_p99_s']} s, last {f['last_answer_s']} s, "
          f"{f['output_tok_per_s']} tok/s, ok {f['requests_ok']}/{sc.workload.count}, continuations "
          f"{f['continuations']}, restarts {f['restarts']}, budgets {f['output_budgets']}; waited for a CPU: {cpu}; "
          f"load {f['load_avg']}", file=sys.stderr, flush=True)  # fmt: skip


async def run_workload(
    sc: Scenario, arms: Sequence[str], rounds: int, workdir: Path, max_run_s: float
) -> dict[str, Any]:
    """The arms side by side on ``sc``, ``rounds`` times, the order rotating every round."""
    per_round: list[dict[str, dict[str, Any]]] = []
    for rnd in range(rounds):
        figures: dict[str, dict[str, Any]] = {}
        for k in range(len(arms)):
            arm = arms[(k + rnd) % len(arms)]
            mode, control = arm_control(arm)
            res = await run_arm(sc, arm, _START_ARGS, mode, workdir / f"{sc.name}-{rnd + 1}-{arm}",
                                max_run_s=max_run_s, control=control, pacing=shipped_pacing())  # fmt: skip
            figures[arm] = {"order": k + 1, **arm_figures(sc, res)}
            _say(sc, rnd, arm, figures[arm])
        per_round.append(figures)
    return {"scenario": sc.name, "premise": sc.premise, "workload": sc.workload.describe(), "time_scale": sc.time_scale,
            "gpu": sc.gpu, "model": sc.model, "rounds_run": rounds, "rounds": per_round,
            "summary": aggregate(per_round)}  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests budget", description=__doc__.split("\n")[0])
    p.add_argument("--report", default="budget.json", help="JSON report; its markdown table beside it (.md)")
    p.add_argument("--workloads", default="bursty,mix", help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--rounds", type=int, default=2, help="each arm this many times, the order rotating")
    p.add_argument("--count", type=int, default=2000, help="requests per workload")
    p.add_argument("--rate", type=float, default=7.0, help="requests per modelled second")
    p.add_argument("--time-scale", type=float, default=4.0, help="the simulated worker runs this much faster")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(200, 600), metavar=("LO", "HI"), help="prompt tokens")
    p.add_argument("--workdir", default=None, help="keep each arm's policy, logs and journal here")
    p.add_argument("--max-run-s", type=float, default=900.0, help="give up on an arm after this long")
    ns = p.parse_args(argv)
    names = [w for w in ns.workloads.split(",") if w]
    arms = [a for a in ns.arms.split(",") if a]
    if bad := [x for x in names if x not in WORKLOADS] + [a for a in arms if a not in ARMS]:
        p.error(f"unknown workload or arm: {', '.join(bad)}")
    chosen = {n: s for n, s in workloads(ns.count, ns.rate, ns.time_scale, tuple(ns.prompt_len)).items() if n in names}
    work = Path(ns.workdir) if ns.workdir else Path(tempfile.mkdtemp(prefix="pacer-budget-"))
    report: dict[str, Any] = {"policy": str(SHIPPED_POLICY.name), "control": shipped_control(),
                              "pacing": shipped_pacing(), "arms": arms, "workloads": {}}  # fmt: skip
    for name, sc in chosen.items():
        report["workloads"][name] = asyncio.run(run_workload(sc, arms, ns.rounds, work, ns.max_run_s))
    path = Path(ns.report)
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(table(report) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
