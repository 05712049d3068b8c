"""The per-phase oracle's gain split into the workload's and the sample's (loadtests.phase_noise): each
phase replayed alone on its own seed and resampled ones, the pick made on the resampled seeds only;
arguments to compare with an output budget and a hold on the worker's open requests."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from loadtests.phase_noise import RESEED, Candidate, candidates, main, phase_noise, table
from loadtests.phase_oracle import phase_scores
from loadtests.scenario_defs import Phases, Scenario, Workload
from loadtests.scenarios import replayed

CHAT = {"prompt_len": (100, 300), "max_tokens": 4096, "output_len": (50, 150), "rate": 2.0}
TINY = Scenario(
    name="tiny-shift",
    premise="test",
    workload=Phases(parts=(
        Workload(count=30, seed=21, **CHAT),  # type: ignore[arg-type]
        Workload(count=30, prompt_len=(100, 300), max_tokens=800, output_len=(600, 800), start_s=60.0, seed=22),
    )),
    start_args={"schedule_conservativeness": 0.3, "max_total_tokens": 20000},
    gpu="a100-40gb",
)  # fmt: skip
SWEEP: dict[str, Any] = {
    "best": {"args": {"schedule_conservativeness": 0.3, "max_total_tokens": 20000}},
    "phase_oracle": {"phases": [
        {"phase": 0, "best_args": {"schedule_conservativeness": 0.1, "max_total_tokens": 20000}},
        {"phase": 1, "best_args": {"schedule_conservativeness": 1.0, "max_total_tokens": 20000, "x": None}},
    ]},
}  # fmt: skip


def test_each_phase_is_scored_on_its_own_seed_and_resampled_ones() -> None:
    report = phase_noise(TINY, candidates(TINY, SWEEP), resamples=2)
    # the operator's arguments are the best single ones here: named once
    assert list(report["candidates"]) == ["best single", "phase 0 best", "phase 1 best"]
    assert report["candidates"]["phase 1 best"]["args"] == {"schedule_conservativeness": 1.0, "max_total_tokens": 20000}
    for k, ph in enumerate(report["phases"]):
        part = TINY.workload.parts[k]  # type: ignore[union-attr]
        assert ph["own_seed"] == part.seed
        assert list(ph["seeds"]) == [str(part.seed + RESEED * i) for i in range(3)]
        assert all(row["best single"]["gain"] == 1.0 for row in ph["seeds"].values())
        # a resampled seed's figures are its own replay's
        seed = part.seed + RESEED
        alone = Phases(parts=(dataclasses.replace(part, seed=seed),))
        args = report["candidates"][f"phase {k} best"]["args"]
        base = phase_scores(alone, replayed(TINY, SWEEP["best"]["args"], alone.specs()).answer_s)[0]
        mine = phase_scores(alone, replayed(TINY, args, alone.specs()).answer_s)[0]
        assert ph["seeds"][str(seed)][f"phase {k} best"]["gain"] == pytest.approx(mine / base, abs=1e-4)
        own = ph["seeds"][str(part.seed)]
        assert ph["oracle_gain"] == pytest.approx(max(r["gain"] for r in own.values()), abs=1e-4)
        assert ph["reachable"] == pytest.approx(own[ph["resampled_pick"]]["gain"] / ph["oracle_gain"], abs=1e-3)
        assert 0 < ph["reachable"] <= 1.0
    assert "phase 1" in table(report) and f"all {report['reachable']:.3f}" in table(report)


def test_what_ifs_are_shown_with_a_budget_and_a_hold_and_never_picked() -> None:
    """The chat's answers (50-150 tokens) fit under a budget of 200: they ask for 200, not 4096; the
    batch's (600-800) do not. A hold of 3 open requests serves the batch far slower than no hold."""
    given = {"schedule_conservativeness": 0.3, "max_total_tokens": 20000}
    named = candidates(TINY, SWEEP, {"mine": given}, budget=200, hold=3)
    assert [n for n in named if n.startswith("mine")] == ["mine", "mine + budget 200", "mine + budget 200, held at 3"]
    chat, batch = TINY.workload.parts  # type: ignore[union-attr]
    assert {s.max_new_tokens for s in named["mine + budget 200"].specs(chat)} == {200}
    assert {s.max_new_tokens for s in named["mine + budget 200"].specs(batch)} == {800}
    report = phase_noise(TINY, named, resamples=1)
    for ph in report["phases"]:
        assert not ph["resampled_pick"].startswith("mine")
        own = ph["seeds"][str(ph["own_seed"])]
        assert own["mine"]["gain"] == 1.0  # the best single arguments themselves, shown and not picked
        assert own["mine + budget 200, held at 3"]["peak_running"] <= 3
    batch_row = report["phases"][1]["seeds"][str(batch.seed)]
    assert batch_row["mine + budget 200, held at 3"]["gain"] < 0.5


def test_a_scenario_without_phases_or_resamples_is_refused() -> None:
    with pytest.raises(ValueError, match="no phases"):
        flat = dataclasses.replace(TINY, workload=Workload(count=3, **CHAT))  # type: ignore[arg-type]
        phase_noise(flat, {"best single": Candidate(args={})}, 1)
    with pytest.raises(ValueError, match="resamples"):
        phase_noise(TINY, candidates(TINY, SWEEP), 0)
    with pytest.raises(SystemExit):
        main(["prefix-none"])  # not a phased scenario: argparse refuses it


def test_a_what_if_that_scores_best_is_still_not_the_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    import loadtests.phase_noise as pn

    def score(sc: Scenario, part: Any, c: Candidate) -> dict[str, float]:
        return {"score": 2.0 if c.shown_only else 1.5 if c.args.get("schedule_conservativeness") == 1.0 else 1.0,
                "peak_running": 1}  # fmt: skip

    monkeypatch.setattr(pn, "_score", score)
    named = candidates(TINY, SWEEP, {"mine": {"schedule_conservativeness": 0.7}})
    report = phase_noise(TINY, named, resamples=1)
    for ph in report["phases"]:
        assert ph["resampled_pick"] == "phase 1 best" and ph["oracle_gain"] == 1.5 and ph["reachable"] == 1.0
        assert ph["seeds"][str(ph["own_seed"])]["mine"]["gain"] == 2.0
