"""The decision journal in the shared store (``[store] url``): every replica's decisions in one place.

:class:`SharedJournal` keeps :class:`~proxy.control.journal.Journal`'s rules (an entry appended whole
at each change, an id's last row its state), in a table of the store instead of a file: each row
names its replica, and every entry carries ``replica``. Its :meth:`~SharedJournal.entries` are the
fleet's: this replica's own, and the others' as it last read them (every :data:`POLL_S`, the rows added
since), so ``GET /admin/decisions``, the dashboard and ``pacer decisions`` on any replica show every
replica's decisions. A replica started again under the same name takes up its own rows, as a
restarted proxy takes up its file.

Rows are written and read on a thread of the journal's own, never on the event loop; rows written
while the store is unreachable wait and go once it is back. The table grows as the file does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from proxy.control.journal import Journal
from proxy.store.sql import Database, StoreUnavailable, is_postgres_url, open_database
from proxy.store.thread import StoreThread

__all__ = ["POLL_S", "SharedJournal", "close_journal", "open_journal"]

_log = logging.getLogger(__name__)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS decisions (seq {serial}, replica TEXT NOT NULL, id {bigint} NOT NULL, "
    "entry TEXT NOT NULL)",
)
_INDEXES = ("CREATE INDEX IF NOT EXISTS decisions_replica ON decisions (replica, id)",)
_OVERLAP = 1000  # rows read again each poll: a row committed after a later one is not missed
# How often a replica reads the others' new decisions (and writes its own that waited for the store).
# The dashboard asks every second: reading more often would show no decision sooner. A read is one
# indexed query of a few milliseconds, next to nothing for the server per replica.
POLL_S = 1.0


class SharedJournal(Journal):
    """Open with :meth:`open`; :meth:`close` when done."""

    def __init__(
        self, db: Database, replica: str, *, keep: int = 1000, wall_clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(None, keep=keep, wall_clock=wall_clock)
        self.replica = replica
        self._stamp = {"replica": replica}
        self._db = db
        self._thread = StoreThread("journal-store")
        self._pending: list[tuple[int, bytes]] = []
        self._flushing: asyncio.Future[None] | None = None
        self._others: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}  # (replica, id) -> (seq, entry)
        self._seq = 0
        self._poller: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, open_db: Callable[[], Database], replica: str, *, keep: int = 1000, poll_s: float = POLL_S
    ) -> SharedJournal:
        """The journal of ``replica`` over the database ``open_db`` opens (off the event loop):
        its own earlier rows taken up, the others' read, then read again every ``poll_s``."""
        opener = StoreThread("journal-open")
        try:
            db = await opener.call(open_db)
        finally:
            opener.shutdown()
        journal = cls(db, replica, keep=keep)
        own = await journal._call(journal._load)
        journal._take_up(own, f"in the store (replica {replica})")
        await journal._read_others()
        journal._poller = asyncio.create_task(journal._poll(poll_s), name="journal poll")
        return journal

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await self._thread.call(fn)

    def _load(self) -> dict[int, dict[str, Any]]:
        self._db.create(_SCHEMA, {}, _INDEXES)
        latest: dict[int, dict[str, Any]] = {}
        for row in self._db.execute("SELECT id, entry FROM decisions WHERE replica=? ORDER BY seq", (self.replica,)):
            latest[int(row["id"])] = orjson.loads(row["entry"])
        return latest

    def _write(self, entry: Mapping[str, Any]) -> None:
        self._pending.append((int(entry["id"]), orjson.dumps(entry)))
        if self._flushing is None or self._flushing.done():
            with contextlib.suppress(RuntimeError):  # no loop (a test's plain call): the next poll writes it
                self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            rows, self._pending = self._pending, []
            try:
                await self._call(partial(self._insert, rows))
            except Exception as exc:
                self._pending[:0] = rows
                _log.warning("cannot write the decision journal to the store (kept, tried again): %s", exc)
                return

    def _insert(self, rows: list[tuple[int, bytes]]) -> None:
        with self._db.transaction():
            self._db.executemany(
                "INSERT INTO decisions (replica, id, entry) VALUES (?,?,?)",
                [(self.replica, entry_id, data.decode()) for entry_id, data in rows],
            )

    def _select_others(self, since: int) -> list[tuple[int, str, dict[str, Any]]]:
        rows = self._db.execute(
            "SELECT seq, replica, entry FROM decisions WHERE seq>? AND replica<>? ORDER BY seq",
            (since, self.replica),
        ).fetchall()
        return [(int(r["seq"]), r["replica"], orjson.loads(r["entry"])) for r in rows]

    async def _read_others(self) -> None:
        for seq, replica, entry in await self._call(partial(self._select_others, max(0, self._seq - _OVERLAP))):
            self._seq = max(self._seq, seq)
            key = (replica, int(entry["id"]))
            if key not in self._others or self._others[key][0] < seq:
                self._others[key] = (seq, entry)
        if len(self._others) > 2 * (self._entries.maxlen or len(self._others)):
            newest = sorted(self._others.items(), key=lambda kv: kv[1][1].get("time", ""))
            self._others = dict(newest[-(self._entries.maxlen or 0) :])

    async def _poll(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._flush()
                await self._read_others()
            except Exception as exc:
                _log.warning("cannot read the other replicas' decisions from the store: %s", exc)

    def entries(self, *, worker: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Every replica's entries, in time order, newest last; ``limit`` keeps the newest ``limit``."""
        fleet = [dict(e) for e in self._entries] + [dict(e) for _, e in self._others.values()]
        found = sorted((e for e in fleet if worker is None or e["worker"] == worker), key=lambda e: e.get("time", ""))
        found = found[-(self._entries.maxlen or len(found)) :]
        return found[-limit:] if limit else found

    async def close(self) -> None:
        """Stop reading; write what is pending (once more, if the store is there)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing
        with contextlib.suppress(Exception):
            await self._flush()
        await self._call(self._db.close)
        self._thread.shutdown()


async def open_journal(path: str | Path | None, store_url: str, replica: str) -> Journal:
    """The proxy's journal: in the store when ``store_url`` names a PostgreSQL server (as ``replica``),
    else in ``path``'s file (or memory). A store that cannot be reached: the file, saying so."""
    if not is_postgres_url(store_url):
        return Journal(path)
    try:
        return await SharedJournal.open(partial(open_database, store_url, Path(), "unused"), replica)
    except StoreUnavailable as exc:
        _log.warning("the decision journal stays in this replica (%s): %s", path or "memory", exc)
        return Journal(path)


async def close_journal(journal: Journal) -> None:
    if isinstance(journal, SharedJournal):
        await journal.close()
