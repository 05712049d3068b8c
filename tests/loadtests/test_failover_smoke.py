"""``python -m loadtests failover`` at tiny scale (the shipped leader lease): both pacing arms report their
queues, and the failover part a new leader, the same worker pids and no failure on a survivor."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loadtests import failover
from proxy.workers.replicas import LEADER_LEASE_S, POLL_S
from tests.harness.postgres import MISSING, postgres_bin

pytestmark = pytest.mark.long


def test_failover_benchmark_reports_pacing_and_a_takeover(tmp_path: Path) -> None:
    if postgres_bin() is None:
        pytest.skip(MISSING)
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
    report = tmp_path / "failover.json"
    argv = ["--seconds", "1", "--before", "1", "--after", "1"]
    assert failover.main([*argv, "--burst", "4", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert set(data["pacing"]) == {"alone", "share"}
    assert all(arm["queue"]["samples"] > 0 and arm["answered"] > 0 for arm in data["pacing"].values())
    taken = data["failover"]
    assert taken["to_leader_s"] <= LEADER_LEASE_S + 2 * POLL_S + 5  # the lease, a poll or two, a loaded machine's slack
    assert taken["pids_after"] == taken["pids_before"]
    assert taken["survivors_failed"] == 0 and all(n > 0 for n in taken["survivors_answered"])
