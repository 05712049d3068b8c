"""The fleet's roster in the store: the leader's workers as it sees them, and the replicas alive.

Several replicas on one PostgreSQL (``[store] url``): the leader (the holder of the lease
:data:`LEADER`, :mod:`proxy.store.lease`) publishes each worker (id, url, state, arguments, pid: a
JSON record) with its term; the other replicas read them and serve the same workers. A publish is
fenced: it lands only while its holder has the lease in that term, in the transaction that checks
it, and never over a row of a later term. Each replica also stamps itself alive (:meth:`Roster.beat`);
:meth:`Roster.live` counts the replicas seen within a span (the pacing divides the band by it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.store.sql import Database

__all__ = ["LEADER", "Roster", "RosterEntry"]

LEADER = "leader"  # the name of the leader lease

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS fleet_workers (id TEXT PRIMARY KEY, record TEXT NOT NULL, "
    "term {bigint} NOT NULL, updated_at {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS fleet_replicas (id TEXT PRIMARY KEY, about TEXT NOT NULL, seen_at {real} NOT NULL)",
)


@dataclass(frozen=True, slots=True)
class RosterEntry:
    """One worker as the leader of ``term`` published it (``record``: its fields, JSON's types)."""

    id: str
    record: Mapping[str, Any]
    term: int
    updated_at: float


class Roster:
    """The roster on one connection; its methods block (run them off the event loop)."""

    def __init__(self, db: Database, *, lease: str = LEADER, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._lease = lease
        self._clock = clock
        db.create(_SCHEMA, {}, ())

    def publish(self, holder: str, term: int, records: Sequence[Mapping[str, Any]]) -> bool:
        """Write each worker's ``record`` (its ``id`` keys it) as the leader ``holder`` of ``term``;
        False, nothing written, when ``holder`` does not hold the lease in that term now."""
        now = self._clock()
        with self._db.transaction() as db:
            row = db.execute(
                "SELECT holder, term, expires_at FROM leases WHERE name=?{for_update}", (self._lease,)
            ).fetchone()
            if row is None or (row["holder"], row["term"]) != (holder, term) or row["expires_at"] <= now:
                return False
            for record in records:
                db.execute(
                    "INSERT INTO fleet_workers (id, record, term, updated_at) VALUES (:id, :record, :term, :now) "
                    "ON CONFLICT (id) DO UPDATE SET record=excluded.record, term=excluded.term, "
                    "updated_at=excluded.updated_at WHERE fleet_workers.term <= excluded.term",
                    {"id": str(record["id"]), "record": json.dumps(record, default=str), "term": term, "now": now},
                )
        return True

    def read(self) -> list[RosterEntry]:
        """Every worker as last published, by id."""
        rows = self._db.execute("SELECT id, record, term, updated_at FROM fleet_workers ORDER BY id").fetchall()
        return [RosterEntry(r["id"], json.loads(r["record"]), r["term"], r["updated_at"]) for r in rows]

    def beat(self, replica: str, about: Mapping[str, Any]) -> None:
        """``replica`` is alive now (``about``: what it says of itself, its host and pid)."""
        with self._db.transaction() as db:
            db.execute(
                "INSERT INTO fleet_replicas (id, about, seen_at) VALUES (:id, :about, :now) "
                "ON CONFLICT (id) DO UPDATE SET about=excluded.about, seen_at=excluded.seen_at",
                {"id": replica, "about": json.dumps(about, default=str), "now": self._clock()},
            )

    def leave(self, replica: str) -> None:
        """``replica`` stops: it no longer counts as alive."""
        with self._db.transaction() as db:
            db.execute("DELETE FROM fleet_replicas WHERE id=?", (replica,))

    def live(self, within_s: float) -> int:
        """How many replicas were seen within the last ``within_s`` seconds."""
        row = self._db.execute(
            "SELECT COUNT(*) AS n FROM fleet_replicas WHERE seen_at > ?", (self._clock() - within_s,)
        ).fetchone()
        return int(row["n"])
