"""The decision journal: every decision with its evidence, what was done, and how it turned out.

Entries live in memory (the newest ``keep``, for ``GET /admin/decisions``) and, when a path is
given, in a JSON-lines file that a restarted proxy takes up (:meth:`Journal._resume`). An entry
changes as its story unfolds (``acting`` -> ``applied`` -> outcome measured); each change appends
the whole entry again with the same ``id``, so the file is append-only and an id's last line is
its current state.

A planner's decision carries the twin's ``predicted_gain`` and ``predicted_throughput``. After the
restart, the first window gives ``first_window_gain`` (standing in as ``measured_gain`` until
replaced); then the twin is checked on the requests served under the new args
(:func:`~proxy.control.planner.check_outcome`), giving ``prediction_error`` and a ``measured_gain``
over those requests rather than the refill. A plan that does not pay is ``noted`` once per
cool-down with its ``predicted_gain`` and ``current_prediction_error``.

An entry's ``status`` is a :class:`Status`; its ``evidence`` is the decision's
(``Decision.evidence_json``); an outcome's ``verdict`` is a :class:`Verdict`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from proxy.control.decision import Decision
from proxy.policy import ControlMode

__all__ = ["Journal", "Status", "Verdict", "verdict"]

_log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class Status(StrEnum):
    """Where an entry's story stands."""

    ADVISED = "advised"  # mode advise (or a worker this proxy does not manage): what auto would have done
    REFUSED = "refused"  # held back (the gate, or another worker restarting), the reason in ``detail``
    NOTED = "noted"  # an observation, nothing to restart
    ACTING = "acting"  # the restart is under way
    APPLIED = "applied"  # the worker is serving with the new args
    REVIVED = "revived"  # a dead worker restarted with the same args
    FAILED = "failed"  # it did not come back, or the restart was refused


class Verdict(StrEnum):
    BETTER = "better"
    WORSE = "worse"
    SAME = "same"


def verdict(before: Mapping[str, Any], after: Mapping[str, Any]) -> Verdict:
    """Throughput first (5 % matters), then the retraction rate."""
    tb, ta = before.get("throughput"), after.get("throughput")
    rb, ra = before.get("retraction_rate_per_min") or 0.0, after.get("retraction_rate_per_min") or 0.0
    if isinstance(tb, (int, float)) and isinstance(ta, (int, float)) and tb > 0:
        if ta > tb * 1.05:
            return Verdict.BETTER
        if ta < tb * 0.95:
            return Verdict.WORSE
    if ra < rb * 0.5 or (rb > 0 and ra == 0):
        return Verdict.BETTER
    if ra > max(rb * 2.0, rb + 1.0):
        return Verdict.WORSE
    return Verdict.SAME


class Journal:
    _stamp: Mapping[str, Any] = {}  # fields every entry of this journal carries (a shared one: its replica)

    def __init__(
        self, path: str | Path | None = None, *, keep: int = 1000, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(path) if path else None
        self._entries: deque[dict[str, Any]] = deque(maxlen=keep)
        self._by_id: dict[int, dict[str, Any]] = {}
        self._next_id = 1
        self._wall = wall_clock
        if self.path is not None:
            self._resume(self.path)

    def _resume(self, path: Path) -> None:
        """Take up the file an earlier run wrote: its entries (the last line of each id, the newest
        ``keep``) are the views' history again, and ids go on after its highest (a second ``"id": 1``
        would break the file's rule that an id's last line is its state). An entry still ``acting``
        was under way when that run stopped: it is closed as ``failed``, saying so. A line cut short
        by a killed process is skipped."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            _log.warning("cannot read decision journal %s: %s; its history starts afresh", path, exc)
            return
        if raw and not raw.endswith(b"\n"):  # cut short: the next entry must begin a line of its own
            self._write_raw(b"\n")
        latest: dict[int, dict[str, Any]] = {}
        bad = 0
        for line in raw.splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                bad += 1
                continue
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                latest[entry["id"]] = entry
            else:
                bad += 1
        if bad:
            _log.warning("decision journal %s: %d unreadable lines skipped", path, bad)
        self._take_up(latest, str(path))

    def _take_up(self, latest: Mapping[int, dict[str, Any]], source: str) -> None:
        """An earlier run's entries (each id's current state) as this journal's history: the newest
        ``keep``, ids going on after the highest, an entry left ``acting`` closed as ``failed``."""
        for entry_id in sorted(latest)[-(self._entries.maxlen or len(latest)) :]:
            self._entries.append(latest[entry_id])
            self._by_id[entry_id] = latest[entry_id]
        self._next_id = max(latest, default=0) + 1
        for entry in list(self._entries):
            if entry.get("status") == Status.ACTING:
                self.update(entry["id"], status=Status.FAILED, detail="the proxy stopped while it was under way")
        if latest:
            _log.info("decision journal %s: %d decisions of earlier runs taken up", source, len(latest))

    def record(
        self,
        decision: Decision,
        *,
        mode: ControlMode,
        status: Status,
        detail: str = "",
        before: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> int:
        """Journal a decision; returns the entry's id. ``extra``: more top-level fields (a plan's
        ``predicted_gain``...)."""
        entry: dict[str, Any] = {
            "id": self._next_id,
            "time": datetime.fromtimestamp(self._wall(), UTC).isoformat(timespec="milliseconds"),
            "monotonic": round(decision.time, 3),
            "worker": decision.worker_id,
            "rule": decision.rule,
            "kind": str(decision.kind),
            "action": str(decision.action),
            "mode": mode,
            "status": status,
            "reason": decision.reason,
            "evidence": decision.evidence_json(),
            "old_args": _plain(decision.old_args),
            "new_args": _plain(decision.new_args),
            "changes": {k: [_plain(a), _plain(b)] for k, (a, b) in decision.changes.items()},
            "delay_s": decision.delay_s,
            "detail": detail,
            "outcome": {"before": _plain(before)} if before is not None else None,
            **_plain(extra or {}),
            **self._stamp,
        }
        self._next_id += 1
        if len(self._entries) == self._entries.maxlen:
            self._by_id.pop(self._entries[0]["id"], None)
        self._entries.append(entry)
        self._by_id[entry["id"]] = entry
        self._write(entry)
        return int(entry["id"])

    def update(
        self,
        entry_id: int,
        *,
        status: Status | None = None,
        detail: str | None = None,
        outcome: Mapping[str, Any] | None = None,
        act: Mapping[str, Any] | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Change fields of an entry (None if it aged out of memory): the ones given; ``outcome``
        keys are merged into the outcome, ``act`` is what carrying the decision out did."""
        entry = self._by_id.get(entry_id)
        if entry is None:
            return None
        if status is not None:
            entry["status"] = status
        if detail is not None:
            entry["detail"] = detail
        if outcome is not None:
            entry["outcome"] = {**(entry["outcome"] or {}), **_plain(outcome)}
        if act is not None:
            entry["act"] = _plain(act)
        if fields is not None:
            entry.update(_plain(fields))
        entry["updated"] = datetime.fromtimestamp(self._wall(), UTC).isoformat(timespec="milliseconds")
        self._write(entry)
        return entry

    def get(self, entry_id: int) -> dict[str, Any] | None:
        return self._by_id.get(entry_id)

    def entries(self, *, worker: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest last; ``limit`` keeps the newest ``limit``."""
        found = [dict(e) for e in self._entries if worker is None or e["worker"] == worker]
        return found[-limit:] if limit else found

    def _write(self, entry: Mapping[str, Any]) -> None:
        self._write_raw(orjson.dumps(entry) + b"\n")

    def _write_raw(self, data: bytes) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as f:
                f.write(data)
        except OSError as exc:
            _log.warning("cannot append to decision journal %s: %s", self.path, exc)
