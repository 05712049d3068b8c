"""``python -m loadtests phase-noise NAME``: how much of the per-phase oracle's gain belongs to the
phase's workload and how much to its one sample, and what the fast tier's levers do in each phase.

The per-phase oracle (:mod:`loadtests.phase_oracle`) takes, for each phase, the best of the sweep's
candidates on the scenario's own requests: a choice made in hindsight on one sample. Here each
phase is replayed alone (a fresh engine, in virtual time) on its own seed and on resampled seeds of
the same workload, under the arguments that matter: the sweep's best single ones, the operator's,
and each phase's best. A controller that knew the phase's workload but not its sample would pick the
arguments best on the resampled seeds; ``reachable`` is what they score on the scenario's own sample,
over the oracle's best there (1.0: the oracle's gain is the workload's; below: it is the sample's).
``--what-if`` adds arguments to compare (an arm's own), with an output budget (``--budget``) and with
the gate holding the worker's open requests (``--hold``); they are shown, never picked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.phase_oracle import phase_scores
from loadtests.scenario_defs import SCENARIOS, Phases, Scenario
from loadtests.scenarios import replayed, swept
from proxy.sim.request import RequestSpec

__all__ = ["Candidate", "main", "phase_noise"]

RESEED = 1000  # resampled seeds: the phase's own plus multiples of this


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """Arguments to replay a phase under; ``budget``: the requests whose answer fits under it ask for
    it instead (as the proxy's output budget sends them); ``hold``: the gate holds the worker's open
    requests at that many."""

    args: Mapping[str, Any]
    budget: int | None = None
    hold: int | None = None
    shown_only: bool = False  # a what-if: never the pick

    def specs(self, part: Any) -> list[RequestSpec]:
        specs = Phases(parts=(part,)).specs()
        if self.budget is None:
            return specs
        cap = self.budget
        return [
            dataclasses.replace(s, max_new_tokens=cap)
            if s.output_len is not None and s.output_len < cap < s.max_new_tokens
            else s
            for s in specs
        ]


def candidates(
    sc: Scenario, sweep: Mapping[str, Any], what_if: Mapping[str, Mapping[str, Any]] | None = None,
    budget: int | None = None, hold: int | None = None,
) -> dict[str, Candidate]:  # fmt: skip
    """The candidates by name: the sweep's best single arguments, the operator's, each phase's best
    (each set once), then each ``what_if`` as given, with ``budget``, and with both and ``hold``."""
    named = {"best single": dict(sweep["best"]["args"]), "operator": dict(sc.start_args)}
    for row in (sweep.get("phase_oracle") or {}).get("phases", []):
        named[f"phase {row['phase']} best"] = dict(row["best_args"])
    out: dict[str, Candidate] = {}
    for name, args in named.items():
        clean = {k: v for k, v in args.items() if v is not None}
        if all(c.args != clean for c in out.values()):
            out[name] = Candidate(args=clean)
    for name, given in (what_if or {}).items():
        out[name] = Candidate(args=dict(given), shown_only=True)
        if budget is not None:
            out[f"{name} + budget {budget}"] = Candidate(args=dict(given), budget=budget, shown_only=True)
        if hold is not None:
            label = f"{name} + budget {budget}, held at {hold}" if budget else f"{name}, held at {hold}"
            out[label] = Candidate(args=dict(given), budget=budget, hold=hold, shown_only=True)
    return out


def _score(sc: Scenario, part: Any, c: Candidate) -> dict[str, float]:
    run = replayed(sc, c.args, c.specs(part), hold=c.hold)
    return {"score": phase_scores(Phases(parts=(part,)), run.answer_s)[0], "peak_running": run.peak_running}


def _phase(sc: Scenario, k: int, part: Any, named: Mapping[str, Candidate], resamples: int) -> dict[str, Any]:
    """One phase on its own seed and ``resamples`` more: each candidate's gain over the best single
    arguments and its peak running batch; the pick on the resampled seeds and what it reaches."""
    seeds = [part.seed + RESEED * i for i in range(resamples + 1)]
    runs = {s: {n: _score(sc, dataclasses.replace(part, seed=s), c) for n, c in named.items()} for s in seeds}
    gains = {s: {n: r["score"] / runs[s]["best single"]["score"] for n, r in runs[s].items()} for s in seeds}
    switches = [n for n, c in named.items() if not c.shown_only]
    picked = max(switches, key=lambda n: statistics.fmean(gains[s][n] for s in seeds[1:]))
    own = gains[seeds[0]]
    top = max(own[n] for n in switches)
    seeds_out = {
        str(s): {n: {"gain": round(gains[s][n], 4), "peak_running": r["peak_running"]} for n, r in runs[s].items()}
        for s in seeds
    }
    return {
        "phase": k,
        "judged_on": "throughput" if part.rate is None else "answer_time",
        "seeds": seeds_out,
        "own_seed": seeds[0],
        "oracle_gain": round(top, 4),
        "resampled_pick": picked,
        "reachable": round(own[picked] / top, 4),
    }


def phase_noise(sc: Scenario, named: Mapping[str, Candidate], resamples: int) -> dict[str, Any]:
    """Per phase and seed, each candidate's gain (higher is better) and peak running batch; the
    arguments best on the resampled seeds and what they reach on the scenario's own sample."""
    if not isinstance(sc.workload, Phases):
        raise ValueError(f"{sc.name} has no phases")
    if resamples < 1:
        raise ValueError("resamples: at least 1 (the pick is made on the resampled seeds)")
    phases = [_phase(sc, k, part, named, resamples) for k, part in enumerate(sc.workload.parts)]
    return {
        "scenario": sc.name,
        "candidates": {n: dataclasses.asdict(c) for n, c in named.items()},
        "phases": phases,
        "reachable": round(statistics.geometric_mean(p["reachable"] for p in phases), 4),
        "note": "each phase replayed alone (a fresh engine), modelled seconds; gain: over the sweep's best single "
        "arguments on the same seed; reachable: the arguments best on the resampled seeds, scored on the own "
        "seed, over the best arguments there",
    }


def table(report: Mapping[str, Any]) -> str:
    names = list(report["candidates"])
    lines = [
        "| phase | seed | " + " | ".join(f"{n} (gain, peak running)" for n in names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for ph in report["phases"]:
        for seed, row in ph["seeds"].items():
            own = " (own)" if int(seed) == ph["own_seed"] else ""
            cells = " | ".join(f"{row[n]['gain']:.3f}, {row[n]['peak_running']}" for n in names)
            lines.append(f"| {ph['phase']} | {seed}{own} | {cells} |")
    picks = ", ".join(f"phase {p['phase']}: {p['resampled_pick']} -> {p['reachable']:.3f}" for p in report["phases"])
    lines.append(f"\nreachable (resampled pick on the own sample / its best): {picks}; all {report['reachable']:.3f}")
    return "\n".join(lines)


def _what_if(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    return name, json.loads(args)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests phase-noise", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[n for n, s in SCENARIOS.items() if isinstance(s.workload, Phases)])
    p.add_argument("--sweep", default=None, help="the scenario's sweep (read if it exists, else run and written)")
    p.add_argument("--resamples", type=int, default=3, help="resampled seeds per phase")
    p.add_argument("--what-if", type=_what_if, action="append", default=[], metavar="NAME=JSON",
                   help="more arguments to compare, shown and never picked")  # fmt: skip
    p.add_argument("--budget", type=int, default=None, help="also each --what-if with this output budget")
    p.add_argument("--hold", type=int, default=None, help="also each --what-if held at this many open requests")
    p.add_argument("--report", default=None, help="JSON report; its .md table beside it")
    ns = p.parse_args(argv)
    sc = SCENARIOS[ns.name]
    _, sweep = swept(sc, Path(ns.sweep) if ns.sweep else None)
    report = phase_noise(sc, candidates(sc, sweep, dict(ns.what_if), ns.budget, ns.hold), ns.resamples)
    if ns.report:
        Path(ns.report).write_text(json.dumps(report, indent=1))
        Path(ns.report).with_suffix(".md").write_text(table(report) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
