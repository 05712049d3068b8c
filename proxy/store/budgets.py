"""Per-key rate budgets that several replicas share: token buckets and concurrency slots in the store.

A replica takes units from a key's bucket in chunks (:meth:`Budgets.take`) and spends them itself,
so most of its requests touch no store; what it holds unused it hands back (:meth:`Budgets.give_back`).
Units taken are gone from the bucket until then: the fleet admits no more than the limit, and holds
back at most the chunks its replicas hold. A bucket holds up to ``per_minute`` units and refills at
``per_minute / 60`` a second (:class:`proxy.request.limits.TokenBucket`'s rule, in one row).

Concurrency: each replica holds some of a key's slots (a row per replica, with an expiry it renews,
:meth:`Budgets.renew`); the rows alive never hold more than the limit together, and the slots of a
replica that died come back when its rows run out. Times are the replicas' wall clocks, as the leader
lease's (:mod:`proxy.store.lease`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from proxy.store.sql import Database

__all__ = ["BucketAsk", "BucketGrant", "Budgets", "SlotAsk"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rate_buckets (key TEXT NOT NULL, kind TEXT NOT NULL, level {real} NOT NULL, "
    "updated {real} NOT NULL, PRIMARY KEY (key, kind))",
    "CREATE TABLE IF NOT EXISTS slot_holds (key TEXT NOT NULL, holder TEXT NOT NULL, held INTEGER NOT NULL, "
    "expires_at {real} NOT NULL, PRIMARY KEY (key, holder))",
)
_SLOTS = "slots"  # the bucket row whose lock takes a key's slots in turn


@dataclass(frozen=True, slots=True)
class BucketAsk:
    """Units of one of a key's buckets: at least ``need`` (0: a top-up), up to ``want``; past the need,
    only what the bucket holds beyond ``keep`` (near empty, a replica takes only what it spends now,
    and the last units go to whichever replica's request comes first). A need above the bucket's
    size is granted whole when the bucket is full (the bucket then owes the rest)."""

    kind: str
    per_minute: int
    need: float
    want: float
    keep: float = 0.0


@dataclass(frozen=True, slots=True)
class BucketGrant:
    granted: float
    level: float  # the bucket's level after
    wait_s: float  # nothing granted: until ``need`` is there


@dataclass(frozen=True, slots=True)
class SlotAsk:
    """Slots of a key for this replica to hold in all: at least ``need``, up to ``want``, of ``limit``."""

    limit: int
    need: int
    want: int


@contextmanager
def _unsynced(db: Database) -> Iterator[Database]:
    with db.transaction():
        if db.shared:  # PostgreSQL's; SQLite's commits are the file's
            db.execute("SET LOCAL synchronous_commit TO OFF")
        yield db


def _refilled(level: float, updated: float, per_minute: int, now: float) -> float:
    return min(float(per_minute), level + max(0.0, now - updated) * per_minute / 60.0)


class Budgets:
    """The shared budgets as ``holder`` (one replica) sees them; blocking, one thread at a time."""

    def __init__(self, db: Database, holder: str, *, hold_s: float = 15.0) -> None:
        self._db = db
        self.holder = holder
        self.hold_s = hold_s
        db.create(_SCHEMA, {}, ())

    def _transaction(self) -> AbstractContextManager[Database]:
        """A transaction whose commit does not wait for the server's disk: a bucket's last updates
        lost with a crashed server cost a few requests' worth of a limit, not a request's wait."""
        return _unsynced(self._db)

    def _locked(self, key: str, kind: str, per_minute: int, now: float) -> tuple[float, float]:
        """The bucket's level refilled to ``now`` and the time it is refilled to (the later of ``now`` and
        the last update: a replica whose clock is behind refills nothing), its row (made full when
        new) locked until the transaction ends."""
        row = self._db.execute(
            "INSERT INTO rate_buckets (key, kind, level, updated) VALUES (?,?,?,?) "
            "ON CONFLICT (key, kind) DO UPDATE SET key=excluded.key RETURNING level, updated",
            (key, kind, float(per_minute), now),
        ).fetchone()
        level, updated = float(row["level"]), float(row["updated"])
        if now <= updated:
            return level, updated
        return min(float(per_minute), level + (now - updated) * per_minute / 60.0), now

    def _set(self, key: str, kind: str, level: float, updated: float) -> None:
        self._db.execute(
            "UPDATE rate_buckets SET level=?, updated=? WHERE key=? AND kind=?", (level, updated, key, kind)
        )

    def take(
        self, key: str, buckets: Sequence[BucketAsk], slots: SlotAsk | None, now: float
    ) -> tuple[list[BucketGrant], int | None]:
        """In one transaction: each bucket's grant, and the slots this replica holds after (None: not asked)."""
        grants: list[BucketGrant] = []
        with self._transaction():
            for ask in buckets:
                level, updated = self._locked(key, ask.kind, ask.per_minute, now)
                need = min(ask.need, float(ask.per_minute))
                if ask.need > 0 and level < need:
                    grants.append(BucketGrant(0.0, level, (need - level) * 60.0 / ask.per_minute))
                    granted = 0.0
                else:
                    extra = min(ask.want - ask.need, max(0.0, level - ask.need - ask.keep))
                    granted = max(ask.need, 0.0) + max(extra, 0.0)
                    grants.append(BucketGrant(granted, level - granted, 0.0))
                self._set(key, ask.kind, level - granted, updated)
            held = None if slots is None else self._take_slots(key, slots, now)
        return grants, held

    def _take_slots(self, key: str, ask: SlotAsk, now: float) -> int:
        self._locked(key, _SLOTS, 0, now)  # one replica at a time counts the key's slots
        rows = self._db.execute(
            "SELECT holder, held FROM slot_holds WHERE key=? AND expires_at>?", (key, now)
        ).fetchall()
        others = sum(int(r["held"]) for r in rows if r["holder"] != self.holder)
        mine = next((int(r["held"]) for r in rows if r["holder"] == self.holder), 0)
        free = ask.limit - others
        if free < ask.need:
            return mine
        held = min(ask.want, free)
        self._hold(key, held, now)
        return held

    def _hold(self, key: str, held: int, now: float) -> None:
        self._db.execute(
            "INSERT INTO slot_holds (key, holder, held, expires_at) VALUES (?,?,?,?) "
            "ON CONFLICT (key, holder) DO UPDATE SET held=excluded.held, expires_at=excluded.expires_at",
            (key, self.holder, held, now + self.hold_s),
        )

    def give_back(self, key: str, buckets: Sequence[tuple[str, int, float]], slots: int | None, now: float) -> None:
        """Hand units back (``(kind, per_minute, units)``; a bucket stays at most full) and, when
        ``slots`` is given, hold that many of the key's slots from now on (fewer than before)."""
        with self._transaction():
            for kind, per_minute, units in buckets:
                level, updated = self._locked(key, kind, per_minute, now)
                self._set(key, kind, min(float(per_minute), level + units), updated)
            if slots is not None:
                self._hold(key, slots, now)

    def close(self) -> None:
        self._db.close()

    def renew(self, now: float) -> None:
        """Keep this replica's slots for another ``hold_s``."""
        with self._transaction():
            self._db.execute("UPDATE slot_holds SET expires_at=? WHERE holder=?", (now + self.hold_s, self.holder))

    def level(self, key: str, kind: str, per_minute: int, now: float) -> float:
        """A bucket's level now (a new bucket is full)."""
        row = self._db.execute("SELECT level, updated FROM rate_buckets WHERE key=? AND kind=?", (key, kind)).fetchone()
        return float(per_minute) if row is None else _refilled(row["level"], row["updated"], per_minute, now)

    def slots_held(self, key: str, now: float) -> int:
        """Slots of the key held by every replica alive."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(held), 0) AS n FROM slot_holds WHERE key=? AND expires_at>?", (key, now)
        ).fetchone()
        return int(row["n"])
