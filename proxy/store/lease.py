"""A named lease in the store: one holder at a time, until it stops renewing and the lease runs out.

The leader lease of several replicas on one PostgreSQL (``[store] url``): each replica calls
:meth:`Lease.acquire` every so often (a third of the lease, say); the one it returns held for acts as
the leader until :meth:`Lease.renew` fails, and :meth:`Lease.release` hands it on at once when it stops.
A holder that dies leaves it to another within ``duration_s``. Each change of holder raises the
lease's ``term``, a fencing token: an action stamped with an older term comes from a deposed holder.

Expiry compares the holders' own clocks (``clock``, wall time): hosts whose clocks differ by more than
a small part of ``duration_s`` need NTP. On SQLite it works too, between processes on one host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.store.sql import Database

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires_at {real} NOT NULL, term {bigint} NOT NULL)",
)


_RELEASED = -1.0  # the expiry of a released lease: before any clock's now


@dataclass(frozen=True, slots=True)
class LeaseState:
    """Who holds the lease until when, in which term (one more at each change of holder)."""

    holder: str
    expires_at: float
    term: int


class Lease:
    """The lease ``name`` as seen by ``holder``; its methods run on the caller's thread (blocking)."""

    def __init__(
        self, db: Database, name: str, holder: str, *, duration_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        if duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {duration_s}")
        self._db = db
        self.name = name
        self.holder = holder
        self.duration_s = duration_s
        self._clock = clock
        db.create(_SCHEMA, {}, ())

    def acquire(self) -> LeaseState:
        """Take the lease when it is free or ran out, or extend it when this holder has it; the state
        after (held by this holder or not: compare ``holder``)."""
        with self._db.transaction() as db:
            now = self._clock()  # read once the transaction may write: not stale by a wait for the lock
            db.execute(
                "INSERT INTO leases (name, holder, expires_at, term) VALUES (:name, :holder, :until, 1) "
                "ON CONFLICT (name) DO UPDATE SET holder=excluded.holder, expires_at=excluded.expires_at, "
                "term=leases.term + (CASE WHEN leases.holder=excluded.holder THEN 0 ELSE 1 END) "
                "WHERE leases.holder=excluded.holder OR leases.expires_at<=:now",
                {"name": self.name, "holder": self.holder, "until": now + self.duration_s, "now": now},
            )
            row = db.execute("SELECT holder, expires_at, term FROM leases WHERE name=?", (self.name,)).fetchone()
        return LeaseState(row["holder"], row["expires_at"], row["term"])

    def renew(self) -> bool:
        """Extend the lease this holder has and that has not run out; False: it is no longer held."""
        now = self._clock()
        with self._db.transaction() as db:
            return (
                db.execute(
                    "UPDATE leases SET expires_at=? WHERE name=? AND holder=? AND expires_at>?",
                    (now + self.duration_s, self.name, self.holder, now),
                ).rowcount
                == 1
            )

    def release(self) -> None:
        """Give the lease up now, when this holder has it: the next :meth:`acquire` of another takes it
        (whatever its clock says)."""
        with self._db.transaction() as db:
            db.execute("UPDATE leases SET expires_at=? WHERE name=? AND holder=?", (_RELEASED, self.name, self.holder))

    def current(self) -> LeaseState | None:
        """The lease as the store has it (possibly run out), None when nobody ever took it."""
        row = self._db.execute("SELECT holder, expires_at, term FROM leases WHERE name=?", (self.name,)).fetchone()
        return None if row is None else LeaseState(row["holder"], row["expires_at"], row["term"])
