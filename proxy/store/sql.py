"""One SQL interface, two backends: the embedded SQLite file, or a PostgreSQL server several replicas share.

Callers write their SQL once, with ``?`` (or ``:name``) parameters and a few dialect words in braces
(``{serial}``, ``{blob}``, ``{bigint}``, ``{real}``, ``{without_rowid}``, ``{for_update}``,
``{skip_locked}``); each backend fills them in and translates the parameters. Rows read by name
(``row["id"]``) on both. A transaction is ``with db.transaction():`` (SQLite: ``BEGIN IMMEDIATE``, one
writer at a time; PostgreSQL: read committed, so the rows a statement changes are locked until the
commit and ``{for_update}`` / ``{skip_locked}`` lock what a transaction read).

File contents: SQLite keeps them only in the data directory beside its file. PostgreSQL keeps them in
the database too (table ``file_parts``, in parts of 4 MiB), so any replica serves any file; each
replica keeps a copy in its own data directory, fetched on first use.

Both run synchronously: the caller keeps them off the event loop (one thread per connection).
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import psycopg

PART_BYTES = 4 * 1024 * 1024
_NAMED = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


class StoreUnavailable(Exception):
    """The store cannot be opened: its driver is missing, or its server refused or did not answer."""


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


class Rows(Protocol):
    """What a statement returns, on either backend."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


Params = Sequence[Any] | dict[str, Any]


class Database:
    """A connection to the store, used by one thread at a time."""

    shared: ClassVar[bool]  # other processes may write the same rows at once
    dialect: ClassVar[dict[str, str]]
    _translated: dict[str, str]

    def sql(self, text: str) -> str:
        """``text`` as this backend runs it (cached: callers reuse a few statements)."""
        done = self._translated.get(text)
        if done is None:
            done = self._translated[text] = self.translate(text.format(**self.dialect))
        return done

    def translate(self, text: str) -> str:
        return text

    def execute(self, text: str, params: Params = ()) -> Rows:
        raise NotImplementedError

    def executemany(self, text: str, rows: Iterable[Sequence[Any]]) -> None:
        raise NotImplementedError

    def transaction(self) -> AbstractContextManager[Database]:
        raise NotImplementedError

    def create(self, schema: Sequence[str], added: Mapping[str, Sequence[str]], indexes: Sequence[str]) -> None:
        """The tables (each ``CREATE TABLE IF NOT EXISTS``), the columns added since (``table ->
        "name TYPE ..."``) and the indexes, in one transaction."""
        raise NotImplementedError

    def put_content(self, file_id: str, path: Path) -> None:
        """Keep a file's content where every replica finds it (inside the caller's transaction)."""

    def fetch_content(self, file_id: str, dest: Path) -> bool:
        """Write a file's content to ``dest``; False when the store has none."""
        return False

    def drop_content(self, file_id: str) -> None:
        """Forget a file's content (inside the caller's transaction)."""

    def close(self) -> None:
        raise NotImplementedError


class SqliteDatabase(Database):
    shared = False
    dialect: ClassVar[dict[str, str]] = {
        "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "blob": "BLOB",
        "bigint": "INTEGER",
        "real": "REAL",
        "without_rowid": " WITHOUT ROWID",
        "for_update": "",
        "skip_locked": "",
    }

    def __init__(self, path: Path) -> None:
        # one thread at a time uses the connection, not always the thread that opened it
        self._translated = {}
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")

    def execute(self, text: str, params: Params = ()) -> Rows:
        return self._db.execute(self.sql(text), params)

    def executemany(self, text: str, rows: Iterable[Sequence[Any]]) -> None:
        self._db.executemany(self.sql(text), rows)

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def create(self, schema: Sequence[str], added: Mapping[str, Sequence[str]], indexes: Sequence[str]) -> None:
        for statement in schema:
            self._db.execute(self.sql(statement))
        with self.transaction():  # one process adds them, should two open the file at once
            for table, columns in added.items():
                have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                for column in columns:
                    if column.split()[0] not in have:
                        self._db.execute(self.sql(f"ALTER TABLE {table} ADD COLUMN {column}"))
            for statement in indexes:
                self._db.execute(self.sql(statement))

    def close(self) -> None:
        self._db.close()


class PostgresDatabase(Database):
    shared = True
    dialect: ClassVar[dict[str, str]] = {
        "serial": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        "blob": "BYTEA",
        "bigint": "BIGINT",
        "real": "DOUBLE PRECISION",
        "without_rowid": "",
        "for_update": " FOR UPDATE",
        "skip_locked": " FOR UPDATE SKIP LOCKED",
    }
    _SCHEMA_LOCK = 0x7061636572  # the advisory lock replicas creating the schema at once take in turn

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreUnavailable(
                "store.url names a PostgreSQL server, but its driver is not installed: "
                "pip install 'sglang-pacer[postgres]'"
            ) from None
        self._psycopg = psycopg
        self._url = url
        self._connect_timeout_s = connect_timeout_s
        self._translated = {}
        self._depth = 0  # transactions open on the connection
        self._db = self._connect()

    def _connect(self) -> psycopg.Connection[Any]:
        from psycopg.rows import dict_row

        try:
            return self._psycopg.connect(
                self._url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=max(1, round(self._connect_timeout_s)),
            )
        except self._psycopg.OperationalError as exc:
            raise StoreUnavailable(f"cannot reach the store's PostgreSQL server: {exc}") from None

    def _live(self) -> psycopg.Connection[Any]:
        """The connection, a new one when the last was lost (the server restarted, the network broke)."""
        if self._db.closed or self._db.broken:
            self._db = self._connect()
        return self._db

    def _lost(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"the connection to the store's PostgreSQL server was lost: {exc}")

    def translate(self, text: str) -> str:
        return _NAMED.sub(r"%(\1)s", text.replace("%", "%%").replace("?", "%s"))

    def execute(self, text: str, params: Params = ()) -> Rows:
        """Run one statement. A lost connection is opened again: a read outside a transaction is then
        run again on it; anything else raises :class:`StoreUnavailable` (whether it ran is unknown)."""
        try:
            return self._live().execute(self.sql(text), params)
        except self._psycopg.OperationalError as exc:
            if not self._db.broken:
                raise
            if self._depth or not text.lstrip().upper().startswith("SELECT"):
                raise self._lost(exc) from None
        return self._live().execute(self.sql(text), params)

    def executemany(self, text: str, rows: Iterable[Sequence[Any]]) -> None:
        try:
            with self._live().cursor() as cursor:
                cursor.executemany(self.sql(text), rows)
        except self._psycopg.OperationalError as exc:
            if self._db.broken:
                raise self._lost(exc) from None
            raise

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        """A lost connection found when the transaction begins is opened again (nothing ran yet);
        lost inside it, :class:`StoreUnavailable` (the server rolled the transaction back)."""
        try:
            with contextlib.ExitStack() as stack:
                stack.push(self._begin().__exit__)
                self._depth += 1
                stack.callback(self._left)
                yield self
        except self._psycopg.OperationalError as exc:
            if self._db.broken:
                raise self._lost(exc) from None
            raise

    def _begin(self) -> Any:
        """psycopg's transaction, begun (BEGIN sent), on a new connection when the last was lost."""
        begun = self._live().transaction()
        try:
            begun.__enter__()
        except self._psycopg.OperationalError:
            if not self._db.broken:
                raise
            begun = self._live().transaction()
            begun.__enter__()
        return begun

    def _left(self) -> None:
        self._depth -= 1

    def create(self, schema: Sequence[str], added: Mapping[str, Sequence[str]], indexes: Sequence[str]) -> None:
        with self.transaction():
            self.execute("SELECT pg_advisory_xact_lock(?)", (self._SCHEMA_LOCK,))
            for statement in [
                *schema,
                "CREATE TABLE IF NOT EXISTS file_parts (file_id TEXT NOT NULL, "
                "part INTEGER NOT NULL, data BYTEA NOT NULL, PRIMARY KEY (file_id, part))",
            ]:
                self.execute(statement)
            for table, columns in added.items():
                for column in columns:
                    self.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column}")
            for statement in indexes:
                self.execute(statement)

    def put_content(self, file_id: str, path: Path) -> None:
        self.drop_content(file_id)
        with path.open("rb") as f:
            part = 0
            while data := f.read(PART_BYTES):
                self.execute("INSERT INTO file_parts (file_id, part, data) VALUES (?,?,?)", (file_id, part, data))
                part += 1

    def fetch_content(self, file_id: str, dest: Path) -> bool:
        found = False
        with dest.open("wb") as out:
            part = 0
            while row := self.execute(
                "SELECT data FROM file_parts WHERE file_id=? AND part=?", (file_id, part)
            ).fetchone():
                out.write(row["data"])
                found = True
                part += 1
        return found

    def drop_content(self, file_id: str) -> None:
        self.execute("DELETE FROM file_parts WHERE file_id=?", (file_id,))

    def close(self) -> None:
        self._db.close()


def open_database(url: str, data_dir: Path, name: str) -> Database:
    """The store ``url`` names: "" is the embedded SQLite file ``data_dir/name``; a
    ``postgresql://`` URL a server. :class:`StoreUnavailable` when it cannot be opened."""
    if not url:
        data_dir.mkdir(parents=True, exist_ok=True)
        return SqliteDatabase(data_dir / name)
    if is_postgres_url(url):
        return PostgresDatabase(url)
    raise StoreUnavailable(f"store.url must be a postgresql:// URL or empty (the embedded SQLite), got {url!r}")
