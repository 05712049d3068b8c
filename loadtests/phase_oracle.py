"""The per-phase oracle of a phased scenario: each phase served with its own best static arguments,
the switch between them free. No controller that only switches arguments can do better.

Built from the oracle's sweep, with no run of its own. Every trial of the sweep replays the whole
trace in virtual time under one set of arguments and times each answer. So each phase can be
scored inside every trial, on the figure the live arms are judged on per phase
(``loadtests.scenarios._phase_figures``): output tokens per second from the phase's first arrival
to its last answer for a batch, one over the mean time from arrival to answer for arrivals over
time. A phase's best arguments are the trial that scores it highest (only the sweep's candidates:
no OOM, enough free memory). Its gain is that score over the sweep's best arguments' score on the
same phase (>= 1, since those are among the trials).

Sound where the engine is idle between phases: a phase scored inside a whole-trace replay is then
the phase replayed alone, as a free switch at its start would leave it (each phase says if it ran
``alone``). Only for phases that do not overlap and are not streamed: ``shift``, not ``mixed``.

Judged against the live arms: the live oracle arm (the sweep's best arguments) is scaled phase by
phase by these gains, so the adaptive arm's ratio to the per-phase oracle is, per phase, its ratio to
the oracle arm divided by the gain, and over the run their geometric mean (as ``by phase`` judges).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.oracle import Trial
from loadtests.scenario_defs import Phases

__all__ = ["adaptive_over_phase_oracle", "phase_oracle", "phase_scores", "switchable"]


def switchable(phases: Phases) -> bool:
    """Whether a free switch of arguments between phases means anything: each phase arrives after the
    previous phase's last arrival, and none is streamed (its figure would be the first token's)."""
    if any(p.stream for p in phases.parts):
        return False
    spans = [(min(a), max(a)) for a in (p.arrivals() for p in phases.parts) if a]
    return len(spans) == len(phases.parts) > 1 and all(b[0] >= a[1] for a, b in itertools.pairwise(spans))


def phase_scores(phases: Phases, answer_s: Sequence[float]) -> list[float]:
    """Per phase, the replay's figure (higher is better): a batch's (no ``rate``) output tokens per
    second from its first arrival to its last answer, or one over the mean time from arrival to answer.
    A phase with a request not answered scores 0."""
    arrivals, outputs, phase_of = phases.arrivals(), [r[2] for r in phases.requests()], phases.phase_of()
    out = []
    for k, part in enumerate(phases.parts):
        idx = [i for i, p in enumerate(phase_of) if p == k]
        waits = [answer_s[i] for i in idx] if len(answer_s) == len(arrivals) else []
        if not waits or any(math.isnan(w) for w in waits):
            out.append(0.0)
        elif part.rate is None:
            span = max(arrivals[i] + answer_s[i] for i in idx) - min(arrivals[i] for i in idx)
            out.append(sum(outputs[i] for i in idx) / span if span > 0 else 0.0)
        else:
            mean = sum(waits) / len(waits)
            out.append(1.0 / mean if mean > 0 else 0.0)
    return out


def _alone(phases: Phases, answer_s: Sequence[float], k: int) -> bool:
    """Whether phase ``k`` had the engine to itself in this replay: the phase before it all answered
    before its first arrival, and it all answered before the next phase's first arrival."""
    arrivals, phase_of = phases.arrivals(), phases.phase_of()

    def span(j: int) -> tuple[float, float]:
        idx = [i for i, p in enumerate(phase_of) if p == j]
        return min(arrivals[i] for i in idx), max(arrivals[i] + answer_s[i] for i in idx)

    first, last = span(k)
    before = k == 0 or span(k - 1)[1] <= first
    after = k == len(phases.parts) - 1 or last <= span(k + 1)[0]
    return before and after


def phase_oracle(phases: Phases, trials: Sequence[Trial], best: Trial) -> dict[str, Any] | None:
    """Each phase's best arguments among the sweep's candidate trials, its replay score and its gain
    over the sweep's best arguments on that phase (None: the phases cannot be switched between, or
    the sweep kept no answer times, or the best arguments score 0 on a phase)."""
    if not switchable(phases) or not best.answer_s:
        return None
    base = phase_scores(phases, best.answer_s)
    if min(base) <= 0:
        return None
    scored = [(t, phase_scores(phases, t.answer_s)) for t in trials if t.score > 0 and t.answer_s]
    rows, gains = [], []
    for k, part in enumerate(phases.parts):
        top, scores = max(scored, key=lambda ts: ts[1][k])
        gains.append(scores[k] / base[k])
        rows.append({
            "phase": k, "judged_on": "throughput" if part.rate is None else "answer_time",
            "best_args": {a: v for a, v in top.args.items() if v is not None}, "score": round(scores[k], 6),
            "best_single_score": round(base[k], 6), "gain": round(scores[k] / base[k], 4),
            "alone": _alone(phases, top.answer_s, k),
        })  # fmt: skip
    return {
        "phases": rows,
        "replay_gain": round(statistics.geometric_mean(gains), 4),
        "candidates": len(scored),
        "note": "each phase's best arguments among the sweep's candidate trials, scored on that phase inside the "
        "trial's whole-trace replay (modelled seconds; batch: tok/s, arrivals: 1 / mean answer); gain: over the "
        "sweep's best single arguments on the same phase",
    }


def adaptive_over_phase_oracle(
    phase_rows: Sequence[Mapping[str, Any]] | None, oracle: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The adaptive arm against the per-phase oracle: per phase, its ratio to the live oracle arm
    (throughput over the oracle's for a batch; the oracle's mean time to answer over its own for
    arrivals) divided by that phase's gain, and their geometric mean. None without the live oracle arm,
    the adaptive arm, or a per-phase oracle."""
    if not phase_rows or not oracle or len(oracle["phases"]) != len(phase_rows):
        return None
    ratios = []
    for row, best in zip(phase_rows, oracle["phases"], strict=True):
        mine, static = row.get("adaptive"), row.get("oracle")
        if not isinstance(mine, dict) or not isinstance(static, dict):
            return None
        if best["judged_on"] == "throughput":
            a, b = mine.get("tok_per_s"), static.get("tok_per_s")
        else:
            a, b = static.get("mean_s"), mine.get("mean_s")
        if not a or not b:
            return None
        ratios.append(a / b / best["gain"])
    return {"ratio": round(statistics.geometric_mean(ratios), 4), "phase_ratios": [round(r, 4) for r in ratios]}
