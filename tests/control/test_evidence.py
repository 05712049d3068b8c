"""Typed evidence written flat: each rule's evidence keeps the journal keys readers of the JSON lines know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.control.decision import Decision, KnobChange, RuleKind
from proxy.control.evidence import (
    Admission,
    BatchCapStorm,
    ConservativenessStorm,
    CrashLoop,
    Death,
    DecodeOom,
    Evidence,
    KvCapacity,
    MemoryBand,
    PrefillOom,
    RequestFit,
    Retractions,
    TimidPacing,
    UnplacedOom,
)
from proxy.control.journal import Journal, Status
from proxy.policy import ControlMode

STORM = Retractions(retraction_rate_per_min=30.0, threshold_per_min=6.0, retractions_per_1k_tokens=None,
                    threshold_per_1k_tokens=0.5, retractions=30, observed_s=60.0)  # fmt: skip
STORM_KEYS = [
    "retraction_rate_per_min",
    "threshold_per_min",
    "retractions_per_1k_tokens",
    "threshold_per_1k_tokens",
    "retractions",
    "observed_s",
]


@pytest.mark.parametrize(
    ("evidence", "keys"),
    [
        pytest.param(
            PrefillOom(oom_cause="", log="torch.OutOfMemoryError"), ["oom_phase", "oom_cause", "log"], id="prefill_oom"
        ),
        pytest.param(
            DecodeOom(oom_cause="", peak_running=None, log="l"),
            ["oom_phase", "oom_cause", "peak_running", "log"],
            id="decode_oom",
        ),
        pytest.param(UnplacedOom(log="l"), ["oom_phase", "log"], id="oom"),
        pytest.param(
            CrashLoop(deaths=3, window_s=600.0, fallback="policy"), ["deaths", "window_s", "fallback"], id="crash_loop"
        ),
        pytest.param(
            ConservativenessStorm(storm=STORM, throughput=None), [*STORM_KEYS, "throughput"], id="retraction_storm"
        ),
        pytest.param(
            BatchCapStorm(storm=STORM, running_when_kv_full=24),
            [*STORM_KEYS, "running_when_kv_full"],
            id="retraction_storm-cap",
        ),
        pytest.param(
            BatchCapStorm(
                storm=STORM,
                running_when_kv_full=24,
                fit=RequestFit(kv_capacity_tokens=8192, mean_request_tokens=364.0, requests_that_fit=22),
            ),
            [*STORM_KEYS, "running_when_kv_full", "kv_capacity_tokens", "mean_request_tokens", "requests_that_fit"],
            id="retraction_storm-fit",
        ),
        pytest.param(KvCapacity(log="l"), ["log"], id="kv_capacity-bare"),
        pytest.param(
            KvCapacity(log="l", max_model_len=4096, estimated_max_model_len=1920),
            ["log", "max_model_len", "estimated_max_model_len"],
            id="kv_capacity",
        ),
        pytest.param(
            MemoryBand(available_gpu_mem_gb=3.0, band_gb="5-10"), ["available_gpu_mem_gb", "band_gb"], id="memory_low"
        ),
        pytest.param(
            MemoryBand(available_gpu_mem_gb=13.5, band_gb="5-10", gpu_total_gb_at_least=79.4),
            ["available_gpu_mem_gb", "band_gb", "gpu_total_gb_at_least"],
            id="memory_headroom",
        ),
        pytest.param(
            Admission(
                low_usage_fraction=1.0,
                threshold_fraction=0.7,
                low_usage=0.9,
                mean_usage_waiting=0.64,
                possible_gain=0.4,
                min_gain=0.15,
                retractions=0,
                at_cap_fraction=0.0,
                observed_s=60.0,
                proxy_backlog=None,
            ),
            [
                "low_usage_fraction",
                "threshold_fraction",
                "low_usage",
                "mean_usage_waiting",
                "possible_gain",
                "min_gain",
                "retractions",
                "at_cap_fraction",
                "observed_s",
                "proxy_backlog",
            ],
            id="admission_too_conservative",
        ),
        pytest.param(
            TimidPacing(queue_empty_fraction=0.9, threshold_fraction=0.5),
            ["queue_empty_fraction", "threshold_fraction"],
            id="pacing_too_timid",
        ),
        pytest.param(Death(death="exited", deaths_in_window=1), ["death", "deaths_in_window"], id="revive"),
        pytest.param(
            Death(rule=UnplacedOom(log="l"), death="out of memory", deaths_in_window=2),
            ["oom_phase", "log", "death", "deaths_in_window"],
            id="revive-by-rule",
        ),
        pytest.param(Evidence(), [], id="none"),
    ],
)
def test_evidence_keeps_its_journal_keys(evidence: Evidence, keys: list[str]) -> None:
    assert list(evidence.to_json()) == keys


def test_a_figure_the_rule_had_is_written_even_when_empty() -> None:
    """Optional fields are left out when None; the others are written as null."""
    assert DecodeOom(oom_cause="", peak_running=None, log="l").to_json()["peak_running"] is None
    assert ConservativenessStorm(storm=STORM, throughput=None).to_json()["retractions_per_1k_tokens"] is None


def test_a_journal_takes_up_its_file_after_a_restart(tmp_path: Path) -> None:
    """The proxy started again on the same file: the views have the earlier decisions, ids go on
    after the highest (an id's last line is its state), an entry left acting is closed as failed,
    and a line a killed process cut short is skipped."""
    path = tmp_path / "decisions.jsonl"
    first = Journal(path, wall_clock=lambda: 1_800_000_000.0)
    decision = Decision(worker_id="w0", rule="revive", reason="r", time=1.0, kind=RuleKind.SAFETY,
                        evidence=Death(death="killed by SIGKILL", deaths_in_window=1))  # fmt: skip
    done = first.record(decision, mode=ControlMode.AUTO, status=Status.ACTING)
    first.update(done, status=Status.REVIVED)
    left = first.record(decision, mode=ControlMode.AUTO, status=Status.ACTING)
    with path.open("ab") as f:
        f.write(b'{"id": 3, "worker": "w0", "rul')  # the process killed mid-line

    again = Journal(path, wall_clock=lambda: 1_800_000_100.0)
    assert [(e["id"], e["status"]) for e in again.entries()] == [(done, "revived"), (left, "failed")]
    assert again.get(left)["detail"] == "the proxy stopped while it was under way"  # type: ignore[index]
    assert again.record(decision, mode=ControlMode.AUTO, status=Status.NOTED) == 3
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines() if line.endswith("}")]
    assert ids == [1, 1, 2, 2, 3]  # the cut line was not taken as an entry; no id begins again
    assert Journal(path, keep=1).entries()[0]["id"] == 3  # the newest keep


def test_the_journal_line_carries_the_figures_then_the_knob(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "decisions.jsonl", wall_clock=lambda: 1_800_000_000.0)
    decision = Decision(
        worker_id="w0", rule="retraction_storm", reason="r", time=12.0, kind=RuleKind.CORRECTIVE,
        evidence=ConservativenessStorm(storm=STORM, throughput=2395.1),
        change=KnobChange(knob="conservativeness", arg="schedule_conservativeness", old=1.0, new=1.3, direction=+1),
        old_args={"schedule_conservativeness": 1.0}, new_args={"schedule_conservativeness": 1.3},
    )  # fmt: skip
    entry_id = journal.record(decision, mode=ControlMode.AUTO, status=Status.ACTING)
    journal.update(entry_id, status=Status.APPLIED, act={"drained": True})
    first, last = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert first["evidence"] == {
        "retraction_rate_per_min": 30.0, "threshold_per_min": 6.0, "retractions_per_1k_tokens": None, "threshold_per_1k_tokens": 0.5,
        "retractions": 30, "observed_s": 60.0, "throughput": 2395.1,
        "knob": "conservativeness", "arg": "schedule_conservativeness", "old_value": 1.0, "new_value": 1.3,
    }  # fmt: skip
    assert (first["status"], first["mode"], first["kind"], first["action"]) == (
        "acting",
        "auto",
        "corrective",
        "restart",
    )
    assert (last["id"], last["status"], last["act"]) == (entry_id, "applied", {"drained": True})
    assert first["changes"] == {"schedule_conservativeness": [1.0, 1.3]}
