"""Recorded sample series and log excerpts (``fixtures/``) turned into windows for the rule tests."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from proxy.control.window import Window
from proxy.engines.base import LogEvent, Sample
from proxy.engines.sglang.logs import LogFollower

FIXTURES = Path(__file__).parent / "fixtures"
ENGINE_FIXTURES = Path(__file__).parent.parent / "engines" / "fixtures"


def samples(name: str, *, offset: float = 0.0, until: float | None = None) -> list[Sample]:
    rows = json.loads((FIXTURES / name).read_text())
    out = [Sample(**{**row, "time": row["time"] + offset}) for row in rows]
    return [s for s in out if until is None or s.time <= until + offset]


def log_events(path: Path | str, *, offset: float = 0.0) -> list[LogEvent]:
    """Events of a log excerpt, each read at its line's own timestamp (seconds after the first line)."""
    path = Path(path) if isinstance(path, Path) else FIXTURES / path
    follower = LogFollower()
    events: list[LogEvent] = []
    first: datetime | None = None
    now = offset
    for line in path.read_text().splitlines():
        if line.startswith("[") and line[1:5].isdigit():
            stamp = datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S")
            first = first or stamp
            now = offset + (stamp - first).total_seconds()
        events.extend(follower.feed(line, now))
    return events + follower.flush(now)


def window_of(*items: list[Sample] | list[LogEvent], span_s: float = 60.0, since: float = float("-inf")) -> Window:
    merged = sorted((i for group in items for i in group), key=lambda i: i.time)
    return Window(span_s=span_s, since=since).push_all(merged)
