"""Prometheus text pages (``GET /metrics``) read the way every engine module needs them.

    series = collect_series(page, "vllm:", READ)      # only the read names are parsed
    series.values["num_requests_waiting"], series.labels["cache_config_info"]

An engine's page is mostly histogram buckets that no engine module reads; parsing them cost
milliseconds per scrape on the proxy's event loop. :func:`keep_read_lines` drops the ``prefix``
series outside the read set before the parser sees them (text only, no parsing), so a scrape costs
what the read series cost. Lines that are not ``prefix`` series stay, so a broken page still fails
to parse. Errors are raised as :class:`MetricsParseError`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "MAX",
    "REQUIRED",
    "SUM",
    "Fields",
    "MetricsParseError",
    "Series",
    "collect_series",
    "first_of",
    "keep_read_lines",
    "read_fields",
]


SUM, MAX = "sum", "max"  # how the series of one field combine (over DP ranks, label sets)
# Sample field -> (metric names without the prefix, newest first; how its series combine)
Fields = Mapping[str, tuple[tuple[str, ...], str]]
# the load gauges every engine exports: a page without one of them is not a usable scrape
REQUIRED = ("queue", "running", "token_usage")


class MetricsParseError(ValueError):
    """The page is not Prometheus text, or lacks the load gauges its engine always exports."""


@dataclass(slots=True)
class Series:
    """Every read sample value by name (prefix removed), and the labels of each value in the same order."""

    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    labels: dict[str, list[dict[str, str]]] = field(default_factory=lambda: defaultdict(list))


def _line_name(line: str) -> str:
    """The metric name a line is about: a sample's name, or the family a ``# HELP``/``# TYPE`` names."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 else ""
    if not line.strip():
        return ""
    return line.split("{", 1)[0].split(None, 1)[0]


def keep_read_lines(text: str, prefix: str, read: Collection[str]) -> str:
    """The page without the ``prefix`` series whose name (prefix removed) is not in ``read``.

    A family line (``# TYPE vllm:num_preemptions counter``) stays when its name or its ``_total``
    sample is read (prometheus_client names counter families without ``_total``).
    """
    wanted = frozenset(prefix + n for n in read)
    keep = []
    for line in text.split("\n"):
        name = _line_name(line)
        if not name.startswith(prefix) or name in wanted or name + "_total" in wanted:
            keep.append(line)
    return "\n".join(keep)


def collect_series(text: str, prefix: str, read: Collection[str] | None = None) -> Series:
    """Every sample of every ``prefix`` series (of those in ``read`` when given), prefix removed."""
    if read is not None:
        text = keep_read_lines(text, prefix, read)
    series = Series()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith(prefix):
                    continue
                name = sample.name[len(prefix) :]
                series.values[name].append(float(sample.value))
                series.labels[name].append(dict(sample.labels))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not a Prometheus metrics page: {exc}") from exc
    return series


def first_of(values: Mapping[str, list[float]], names: tuple[str, ...], combine: str) -> float | None:
    """The first of ``names`` (newest first) with samples, combined by ``combine``; None if none has any."""
    for name in names:
        if vals := values.get(name):
            return sum(vals) if combine == SUM else max(vals)
    return None


def read_fields(series: Series, fields: Fields, *, prefix: str, hint: str) -> dict[str, float | None]:
    """Each field's value from ``series``; :class:`MetricsParseError` naming the missing metrics (and
    ``hint``, what to check) when a :data:`REQUIRED` gauge is absent."""
    found = {name: first_of(series.values, names, combine) for name, (names, combine) in fields.items()}
    missing = [f"{prefix}{fields[f][0][0]}" for f in REQUIRED if found[f] is None]
    if missing:
        raise MetricsParseError(f"metrics page lacks {', '.join(missing)} ({hint})")
    return found
