"""The guide's lever scenarios in virtual time: the best static schedule policy differs between heavy
prefix sharing and none, and graphs that cover the batch beat SGLang's default on graph-outgrown.

Each sweeps only the lever (the oracle's coordinate descent over it, the rest at the start's) on the
scenario's first requests behind the arms' own pacing gate; the full sweeps' figures are in the
scenarios' comments. The first 1,000-2,000 requests hold the premise: a backlog far past the gate, the
same heads, prompts and outputs."""

from __future__ import annotations

from dataclasses import replace

from loadtests.oracle import LEVER_VALUES, SearchSpace, sweep
from loadtests.scenario_defs import SCENARIOS
from loadtests.scenarios import scenario_pacing


def _best(name: str, count: int, **levers: tuple[object, ...]) -> tuple[dict[str, object], dict[str, float]]:
    sc = SCENARIOS[name]
    space = SearchSpace(schedule_conservativeness=(None,), chunked_prefill_size=(None,), max_running_requests=(None,),
                        mem_fraction_static=(None,), passes=1, pacing=scenario_pacing(sc), **levers)  # type: ignore[arg-type]  # fmt: skip
    r = sweep(sc.start_args, replace(sc.workload, count=count).specs(), gpu=sc.gpu, model=sc.model, space=space)
    scores = {repr({k: v for k, v in t.args.items() if k in levers}): t.output_tok_per_s for t in r.trials}
    return {k: v for k, v in r.best.args.items() if k in levers}, scores


def test_heavy_sharing_keeps_lpm_and_no_sharing_is_best_at_fcfs() -> None:
    policies = {"schedule_policy": LEVER_VALUES["schedule_policy"]}
    shared, shared_scores = _best("prefix-shared", 2000, **policies)
    none, none_scores = _best("prefix-none", 1000, **policies)
    assert shared["schedule_policy"] == "lpm", shared_scores
    assert none["schedule_policy"] in (None, "fcfs"), none_scores  # None: SGLang's default, fcfs


def test_graphs_that_cover_the_batch_beat_the_default_on_graph_outgrown() -> None:
    best, scores = _best("graph-outgrown", 1500, cuda_graph_max_bs_decode=LEVER_VALUES["cuda_graph_max_bs_decode"])
    assert best["cuda_graph_max_bs_decode"] in (768, 1024), scores
