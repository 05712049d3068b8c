"""The per-phase oracle of a phased scenario: each phase served with its own best static arguments,
the switch between them free. No controller that only switches arguments can do better.

A switch is a restart, so in the oracle each phase starts on a fresh engine at its first arrival:
it is the phase replayed by itself, in virtual time, under each of the sweep's candidate arguments
(no OOM, enough free memory; a few seconds of CPU per candidate and phase). Its best arguments are
those that score it highest; its gain is that score over the sweep's best single arguments' on the
same phase, replayed the same way (>= 1: they are a candidate). Scoring phases inside the sweep's
whole-trace replays instead would need no replay of its own, but there the engine's state carries
over from the phase before, so the same arguments score a phase differently than a switch leaves it.
A phase's figure is the one the live arms are judged on per phase (``scenario_report._phase_figures``):
output tokens per second from its first arrival to its last answer for a batch, one over the mean
time from arrival to answer for arrivals over time. ``alone``: the phase before it, under its own
best arguments, was all answered before this one arrived (the free switch is then exact).
Only for phases that do not overlap and are not streamed: ``shift``, not ``mixed``.

Judged against the live arms: the live oracle arm (the sweep's best arguments) is scaled phase by
phase by these gains, so the adaptive arm's ratio to the per-phase oracle is, per phase, its ratio to
the oracle arm divided by the gain, and over the run their geometric mean (as ``by phase`` judges).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadtests.oracle import Trial
from loadtests.scenario_defs import Phases
from proxy.sim.request import RequestSpec

__all__ = ["Replay", "adaptive_over_phase_oracle", "phase_oracle", "phase_scores", "switchable"]

# a replay of some requests under some arguments: per request, modelled seconds from arrival to answer (NaN: none)
Replay = Callable[[Mapping[str, Any], Sequence[RequestSpec]], Sequence[float]]


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


def _span(phases: Phases, answer_s: Sequence[float], k: int) -> tuple[float, float]:
    """Phase ``k``'s first arrival and last answer (modelled seconds) in a replay of ``phases``."""
    arrivals = phases.arrivals()
    idx = [i for i, p in enumerate(phases.phase_of()) if p == k]
    return min(arrivals[i] for i in idx), max(arrivals[i] + answer_s[i] for i in idx)


def phase_oracle(phases: Phases, trials: Sequence[Trial], best: Trial, replay: Replay) -> dict[str, Any] | None:
    """Each phase replayed alone under each of the sweep's candidate trials' arguments (``replay``: per
    request, its answer time): its best arguments, their score and their gain over the sweep's best
    arguments (``best``) on that phase. None: the phases cannot be switched between, or the best
    arguments score 0 on a phase."""
    if not switchable(phases):
        return None
    candidates = [t for t in trials if t.score > 0 and t.args != best.args]
    rows, gains, spans = [], [], []
    for k, part in enumerate(phases.parts):
        alone = Phases(parts=(part,))
        specs = alone.specs()
        answers = replay(best.args, specs)
        base = phase_scores(alone, answers)[0]
        if base <= 0:
            return None
        top, score, span = best, base, _span(alone, answers, 0)
        for t in candidates:
            answers = replay(t.args, specs)
            if (mine := phase_scores(alone, answers)[0]) > score:
                top, score, span = t, mine, _span(alone, answers, 0)
        gains.append(score / base)
        spans.append(span)
        rows.append({
            "phase": k, "judged_on": "throughput" if part.rate is None else "answer_time",
            "best_args": {a: v for a, v in top.args.items() if v is not None}, "switched": top is not best,
            "score": round(score, 6), "best_single_score": round(base, 6), "gain": round(score / base, 4),
        })  # fmt: skip
    for k, row in enumerate(rows):
        row["alone"] = k == 0 or spans[k - 1][1] <= spans[k][0]
    return {
        "phases": rows,
        "replay_gain": round(statistics.geometric_mean(gains), 4),
        "candidates": len(candidates) + 1,
        "note": "each phase replayed alone (a fresh engine: a free restart at its first arrival) under each of "
        "the sweep's candidate arguments; modelled seconds; batch: tok/s, arrivals: 1 / mean answer; gain: over "
        "the sweep's best single arguments on the same phase, replayed the same way",
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
