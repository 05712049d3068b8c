"""Typed evidence written flat: each rule's evidence keeps the journal keys readers of the JSON lines know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.control.decision import Decision, KnobChange, RuleKind
from proxy.control.evidence import (
    CrashLoop,
    Death,
    DecodeOom,
    Evidence,
    KvCapacity,
    MemoryBand,
    PrefillOom,
    TimidPacing,
    UnplacedOom,
)
from proxy.control.journal import Journal, Status
from proxy.policy import ControlMode


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
        pytest.param(
            DecodeOom(oom_cause="", peak_running=5, log="l", peak_token_usage=0.3),
            ["oom_phase", "oom_cause", "peak_running", "log", "peak_token_usage"],
            id="decode_oom-pool",
        ),
        pytest.param(UnplacedOom(log="l"), ["oom_phase", "log"], id="oom"),
        pytest.param(
            CrashLoop(deaths=3, window_s=600.0, fallback="policy"), ["deaths", "window_s", "fallback"], id="crash_loop"
        ),
        pytest.param(KvCapacity(log="l"), ["log"], id="kv_capacity-bare"),
        pytest.param(
            KvCapacity(log="l", max_context=4096, estimated_max_context=1920),
            ["log", "max_context", "estimated_max_context"],
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
    assert MemoryBand(available_gpu_mem_gb=3.0, band_gb="5-10").to_json() == {
        "available_gpu_mem_gb": 3.0,
        "band_gb": "5-10",
    }


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
        worker_id="w0", rule="memory_headroom", reason="r", time=12.0, kind=RuleKind.TUNING,
        evidence=MemoryBand(available_gpu_mem_gb=13.5, band_gb="5-10", gpu_total_gb_at_least=79.4),
        change=KnobChange(knob="memory_fraction", arg="mem_fraction_static", old=0.8, new=0.86, direction=+1),
        old_args={"mem_fraction_static": 0.8}, new_args={"mem_fraction_static": 0.86},
    )  # fmt: skip
    entry_id = journal.record(decision, mode=ControlMode.AUTO, status=Status.ACTING)
    journal.update(entry_id, status=Status.APPLIED, act={"drained": True})
    first, last = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert first["evidence"] == {
        "available_gpu_mem_gb": 13.5, "band_gb": "5-10", "gpu_total_gb_at_least": 79.4,
        "knob": "memory_fraction", "arg": "mem_fraction_static", "old_value": 0.8, "new_value": 0.86,
    }  # fmt: skip
    assert (first["status"], first["mode"], first["kind"], first["action"]) == (
        "acting",
        "auto",
        "tuning",
        "restart",
    )
    assert (last["id"], last["status"], last["act"]) == (entry_id, "applied", {"drained": True})
    assert first["changes"] == {"mem_fraction_static": [0.8, 0.86]}
