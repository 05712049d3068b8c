"""``pacer decisions`` prints each decision's time as the machine's local time with its zone, as the
dashboard shows it (the journal keeps UTC)."""

from __future__ import annotations

import time

import pytest

from proxy.console.decisions import format_decision


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")  # POSIX rule: no tzdata needed
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("berlin")
def test_a_decision_time_is_printed_local_with_its_zone() -> None:
    entry = {"id": 3, "time": "2026-11-28T12:00:05.250+00:00", "worker": "w0", "rule": "r", "status": "noted"}
    assert format_decision(entry).startswith("#3 2026-11-28 13:00:05 CET w0 r [noted]")
    summer = dict(entry, time="2026-07-01T12:00:05")  # a time with no zone is the journal's UTC
    assert "2026-07-01 14:00:05 CEST" in format_decision(summer)
    assert "not-a-time" in format_decision(dict(entry, time="not-a-time"))
