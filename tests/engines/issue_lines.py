"""Fixture lines copied from the engines' issue trackers, each under a ``# owner/repo#N key=value ...`` line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True, slots=True)
class IssueLine:
    source: str  # "sgl-project/sglang#1270"
    tags: dict[str, str]  # the key=value words of the source line (id=..., cause=...)
    line: str


def issue_lines(name: str) -> list[IssueLine]:
    """The data lines of a fixture file, each with the source line above it (blank lines and prose skipped)."""
    found: list[IssueLine] = []
    source, tags = "", {}
    for text in (FIXTURES / name).read_text().splitlines():
        if text.startswith("# "):
            words = text[2:].split()
            if words and "#" in words[0] and "/" in words[0]:
                source, tags = words[0], dict(w.split("=", 1) for w in words[1:] if "=" in w)
            continue
        if text.strip() and source:
            found.append(IssueLine(source=source, tags=tags, line=text))
    return found


def params(name: str) -> list[object]:
    """``pytest.param`` per line, with the line's ``id`` (or its source) as the test id."""
    return [pytest.param(item, id=item.tags.get("id", item.source)) for item in issue_lines(name)]


def traceback_lines(name: str) -> list[str]:
    """A traceback fixture's lines, without its leading ``#`` comment."""
    lines = (FIXTURES / "oom_tracebacks" / name).read_text().splitlines()
    return [line for line in lines if not line.startswith("# ")]
