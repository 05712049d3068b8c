"""``python -m loadtests store`` at tiny scale: both backends run a batch to the end and the report
carries their per-line figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loadtests import store_overhead
from tests.harness.postgres import MISSING, postgres_bin


def test_store_benchmark_reports_both_backends(tmp_path: Path) -> None:
    if postgres_bin() is None:
        pytest.skip(MISSING)
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
    report = tmp_path / "store.json"
    assert store_overhead.main(["--lines", "40", "--repeats", "1", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert set(data["per_line_ms"]) == {"sqlite", "postgresql"}
    assert all(ms > 0 for ms in data["per_line_ms"].values())
    assert len(data["seconds"]["postgresql"]) == 1
