"""The durable state of the Batch API: one SQLite database (WAL) and the files beside it.

Layout under the data directory: ``batches.sqlite3`` (files, batches, every request line with its
result), ``files/<file id>.jsonl`` (uploads and the output and error files), ``staging/`` (uploads
being received).

Exactly once: a line's result is written to its row, and the batch's counter bumped, in one
transaction that applies only while the row has no result. A line in flight when the process dies
has no result and runs again; a late duplicate is dropped. :meth:`BatchStore.finish` builds the
output and error files from the recorded results, in input order, into a temporary file renamed
into place, then commits the file rows and final status; a crash in between leaves the batch
``finalizing`` (or ``cancelling``) and the next start builds the same files again under the same
ids. WAL with ``synchronous=NORMAL`` keeps every commit across a killed process (not a power cut).

:class:`BatchStore` is synchronous; :class:`StoreThread` runs its methods one at a time on a thread
of its own, so the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, closing, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Concatenate, Literal, ParamSpec, TypeVar

import orjson

from proxy.batch.jsonl import FileRefused, line_problems, validate_lines
from proxy.batch.shapes import CANCELLED, EXPIRED, NO_USAGE, Json, Usage, error_line, file_object, new_id, page

P = ParamSpec("P")
T = TypeVar("T")

Outcome = Literal["output", "error"]
Ending = Literal["completed", "expired", "cancelled"]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, ending TEXT, model TEXT, metadata TEXT, errors TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body BLOB,
    outcome TEXT, result BLOB, PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
"""

# columns added since the first schema, declared here only: every database, new or made before them,
# gets them on open
_ADDED_COLUMNS = {
    "batches": (
        "input_tokens INTEGER NOT NULL DEFAULT 0",
        "cached_tokens INTEGER NOT NULL DEFAULT 0",
        "output_tokens INTEGER NOT NULL DEFAULT 0",
        "reasoning_tokens INTEGER NOT NULL DEFAULT 0",
    )
}
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")


class NotCancellable(Exception):
    """The batch already ended; the message names its status."""


@dataclass(frozen=True, slots=True)
class ActiveBatch:
    """What the runner needs of a batch that is not finished."""

    id: str
    owner: str
    endpoint: str
    status: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class PendingLine:
    idx: int
    custom_id: str
    body: bytes


def _batch_object(row: sqlite3.Row) -> Json:
    out: Json = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "model": row["model"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": orjson.loads(row["metadata"]) if row["metadata"] is not None else None,
        "usage": {  # the answers' own usage, summed over the lines answered so far
            "input_tokens": row["input_tokens"],
            "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
            "output_tokens": row["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": row["reasoning_tokens"]},
            "total_tokens": row["input_tokens"] + row["output_tokens"],
        },
    }
    if row["errors"]:
        out["errors"] = {"object": "list", "data": orjson.loads(row["errors"])}
    out.update({name: row[name] for name in _TIMES})
    return out


def _file_object(row: sqlite3.Row) -> Json:
    return file_object(
        id=row["id"], bytes=row["bytes"], created_at=row["created_at"], filename=row["filename"], purpose=row["purpose"]
    )


class BatchStore:
    """Files, batches and request lines of every owner; each query is scoped to one owner."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.staging_dir = data_dir / "staging"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        # one thread at a time uses the connection (StoreThread), not always the thread that opened it
        self._db = sqlite3.connect(data_dir / "batches.sqlite3", isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        with self._transaction() as db:  # one process adds them, should two open the folder at once
            for table, columns in _ADDED_COLUMNS.items():
                have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
                for column in columns:
                    if column.split()[0] not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    @classmethod
    @contextmanager
    def open(cls, data_dir: Path) -> Iterator[BatchStore]:
        store = cls(data_dir)
        try:
            yield store
        finally:
            store.close()

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    # -- files ---------------------------------------------------------------------------------------

    def add_file(self, owner: str, *, staged: Path, filename: str, purpose: str, now: int) -> Json:
        """Move a completely received upload into place and record it."""
        file_id = new_id("file-")
        size = staged.stat().st_size
        os.replace(staged, self.file_path(file_id))
        with self._transaction() as db:
            db.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?,?,?,?,?,?)",
                (file_id, owner, filename, purpose, size, now),
            )
        return file_object(id=file_id, bytes=size, created_at=now, filename=filename, purpose=purpose)

    def get_file(self, owner: str, file_id: str) -> Json | None:
        row = self._db.execute("SELECT * FROM files WHERE id=? AND owner=?", (file_id, owner)).fetchone()
        return None if row is None else _file_object(row)

    def list_files(self, owner: str, *, after: str | None, limit: int, ascending: bool, purpose: str | None) -> Json:
        op, order = (">", "ASC") if ascending else ("<", "DESC")
        rows = self._db.execute(
            f"SELECT * FROM files WHERE owner=:owner AND (:purpose IS NULL OR purpose=:purpose) "
            f"AND (:after IS NULL OR seq {op} (SELECT seq FROM files WHERE id=:after AND owner=:owner)) "
            f"ORDER BY seq {order} LIMIT :n",
            {"owner": owner, "purpose": purpose, "after": after, "n": limit + 1},
        ).fetchall()
        return page([_file_object(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id=? AND owner=?", (file_id, owner)).rowcount == 1
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return gone

    # -- batches -------------------------------------------------------------------------------------

    def create_batch(
        self, owner: str, *, input_file_id: str, endpoint: str, metadata: dict[str, str] | None, now: int, window_s: int
    ) -> Json:
        batch_id = new_id("batch_")
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata, "
                "created_at, expires_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    batch_id,
                    owner,
                    endpoint,
                    input_file_id,
                    "24h",
                    "validating",
                    orjson.dumps(metadata).decode() if metadata is not None else None,
                    now,
                    now + window_s,
                ),
            )
        batch = self.get_batch(owner, batch_id)
        assert batch is not None
        return batch

    def get_batch(self, owner: str, batch_id: str) -> Json | None:
        row = self._db.execute("SELECT * FROM batches WHERE id=? AND owner=?", (batch_id, owner)).fetchone()
        return None if row is None else _batch_object(row)

    def list_batches(self, owner: str, *, after: str | None, limit: int) -> Json:
        rows = self._db.execute(
            "SELECT * FROM batches WHERE owner=:owner "
            "AND (:after IS NULL OR seq < (SELECT seq FROM batches WHERE id=:after AND owner=:owner)) "
            "ORDER BY seq DESC LIMIT :n",
            {"owner": owner, "after": after, "n": limit + 1},
        ).fetchall()
        return page([_batch_object(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def request_cancel(self, owner: str, batch_id: str, now: int) -> Json | None:
        """``cancelling`` from any unfinished status; a no-op while already cancelling."""
        with self._transaction() as db:
            row = db.execute("SELECT status FROM batches WHERE id=? AND owner=?", (batch_id, owner)).fetchone()
            if row is None:
                return None
            if row["status"] not in ("validating", "in_progress", "cancelling"):
                raise NotCancellable(f"cannot cancel a batch whose status is {row['status']!r}")
            db.execute(
                "UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=? AND status!='cancelling'",
                (now, batch_id),
            )
        return self.get_batch(owner, batch_id)

    # -- the runner's side ---------------------------------------------------------------------------

    def active_batches(self) -> list[ActiveBatch]:
        rows = self._db.execute(
            f"SELECT id, owner, endpoint, status, expires_at FROM batches WHERE status IN {ACTIVE} ORDER BY seq"
        ).fetchall()
        return [ActiveBatch(r["id"], r["owner"], r["endpoint"], r["status"], r["expires_at"]) for r in rows]

    def status(self, batch_id: str) -> str:
        row = self._db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
        return str(row["status"])

    def validate(self, batch_id: str, *, accepts_model: Callable[[str], bool], now: int) -> str:
        """Read a ``validating`` batch's input into request lines: ``in_progress``, or ``failed`` with the reason."""
        row = self._db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
        if row["status"] != "validating":
            return str(row["status"])
        try:
            with self.file_path(row["input_file_id"]).open("rb") as f:
                checked = validate_lines(f, endpoint=row["endpoint"], accepts_model=accepts_model)
        except FileNotFoundError:
            return self._fail(batch_id, now, [("invalid_file", "the input file was deleted", None)])
        except FileRefused as exc:
            return self._fail(batch_id, now, [(exc.code, exc.message, exc.line)])
        if checked.bad:  # as OpenAI: a batch runs only when every line is a request it can send
            return self._fail(batch_id, now, line_problems(checked.bad))
        with self._transaction() as db:
            if db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()["status"] != "validating":
                return self.status(batch_id)  # cancelled meanwhile
            db.execute("DELETE FROM lines WHERE batch_id=?", (batch_id,))
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?,?,?,?)",
                [(batch_id, r.line, r.custom_id, r.body) for r in checked.requests],
            )
            db.execute(
                "UPDATE batches SET status='in_progress', in_progress_at=?, model=?, total=? WHERE id=?",
                (now, checked.model, len(checked.requests), batch_id),
            )
        return "in_progress"

    def _fail(self, batch_id: str, now: int, problems: Sequence[tuple[str, str, int | None]]) -> str:
        """``failed`` at validation, ``errors`` one entry per problem: its code, message and line."""
        errors = orjson.dumps(
            [{"code": code, "message": message, "param": None, "line": line} for code, message, line in problems]
        ).decode()
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET status='failed', failed_at=?, errors=? WHERE id=? AND status='validating'",
                (now, errors, batch_id),
            )
        return self.status(batch_id)

    def pending_lines(self, batch_id: str, *, after: int, limit: int) -> list[PendingLine]:
        rows = self._db.execute(
            "SELECT idx, custom_id, body FROM lines WHERE batch_id=? AND idx>? AND outcome IS NULL "
            "ORDER BY idx LIMIT ?",
            (batch_id, after, limit),
        ).fetchall()
        return [PendingLine(r["idx"], r["custom_id"], r["body"]) for r in rows]

    def record(self, batch_id: str, idx: int, outcome: Outcome, line: bytes, usage: Usage = NO_USAGE) -> bool:
        """Keep a line's result, and add its answer's usage to the batch's, once: False when the line
        already had one."""
        counter = "completed" if outcome == "output" else "failed"
        with self._transaction() as db:
            fresh = (
                db.execute(
                    "UPDATE lines SET outcome=?, result=? WHERE batch_id=? AND idx=? AND outcome IS NULL",
                    (outcome, line, batch_id, idx),
                ).rowcount
                == 1
            )
            if fresh:
                db.execute(
                    f"UPDATE batches SET {counter}={counter}+1, input_tokens=input_tokens+?, "
                    "cached_tokens=cached_tokens+?, output_tokens=output_tokens+?, "
                    "reasoning_tokens=reasoning_tokens+? WHERE id=?",
                    (usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens, batch_id),
                )
        return fresh

    def finish(self, batch_id: str, ending: Ending, now: int) -> None:
        """End a batch: unanswered lines to the error file, the files built, the final status kept."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row["status"] not in ACTIVE:
                return
            if row["ending"] is None:  # a cancelled batch has its cancelling_at and no finalizing_at (OpenAI's)
                db.execute(
                    "UPDATE batches SET ending=?, status=?, finalizing_at=? WHERE id=?",
                    (ending, *(("cancelling", None) if ending == "cancelled" else ("finalizing", now)), batch_id),
                )
            ending = row["ending"] or ending  # a restarted finish ends the way the first one began
            code, message = CANCELLED if ending == "cancelled" else EXPIRED
            left = db.execute(
                "SELECT idx, custom_id FROM lines WHERE batch_id=? AND outcome IS NULL", (batch_id,)
            ).fetchall()
            db.executemany(
                "UPDATE lines SET outcome='error', result=? WHERE batch_id=? AND idx=?",
                [(error_line(r["custom_id"], code=code, message=message), batch_id, r["idx"]) for r in left],
            )
            db.execute("UPDATE batches SET failed=failed+? WHERE id=?", (len(left), batch_id))
        made = {outcome: self._write_results(batch_id, outcome) for outcome in ("output", "error")}
        hex_id = batch_id.removeprefix("batch_")
        with self._transaction() as db:
            for outcome, size in made.items():
                if size is not None:
                    db.execute(
                        "INSERT OR REPLACE INTO files (id, owner, filename, purpose, bytes, created_at) "
                        "VALUES (?,?,?,?,?,?)",
                        (
                            f"file-{hex_id}-{outcome}",
                            row["owner"],
                            f"batch_{hex_id}_{outcome}.jsonl",
                            "batch_output",
                            size,
                            now,
                        ),
                    )
            final_time = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[ending]
            db.execute(
                f"UPDATE batches SET status=?, {final_time}=?, output_file_id=?, error_file_id=? WHERE id=?",
                (
                    ending,
                    now,
                    None if made["output"] is None else f"file-{hex_id}-output",
                    None if made["error"] is None else f"file-{hex_id}-error",
                    batch_id,
                ),
            )

    def _write_results(self, batch_id: str, outcome: Outcome) -> int | None:
        """The batch's file of one outcome, in input order; None (and no file) when it has no line."""
        path = self.file_path(f"file-{batch_id.removeprefix('batch_')}-{outcome}")
        staged = self.staging_dir / path.name
        size = 0
        with (
            staged.open("wb") as out,
            closing(
                self._db.execute(
                    "SELECT result FROM lines WHERE batch_id=? AND outcome=? ORDER BY idx", (batch_id, outcome)
                )
            ) as rows,
        ):
            for (line,) in rows:
                out.write(line + b"\n")
                size += len(line) + 1
            out.flush()
            os.fsync(out.fileno())
        if size == 0:
            staged.unlink()
            return None
        os.replace(staged, path)
        return size


class StoreThread:
    """A :class:`BatchStore` whose every call runs on one thread of its own, one call at a time."""

    def __init__(self, store: BatchStore, executor: ThreadPoolExecutor) -> None:
        self.store = store
        self._executor = executor

    @classmethod
    @asynccontextmanager
    async def open(cls, data_dir: Path) -> AsyncIterator[StoreThread]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store") as executor:
            store = await loop.run_in_executor(executor, BatchStore, data_dir)
            try:
                yield cls(store, executor)
            finally:
                await loop.run_in_executor(executor, store.close)

    async def __call__(self, method: Callable[Concatenate[BatchStore, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(method, self.store, *args, **kwargs))
