"""The durable state of the Batch API: one database (:mod:`proxy.store.sql`) and the files beside it.

The database is the embedded SQLite file ``batches.sqlite3`` (WAL) in the data directory, or a
PostgreSQL server that several replicas share (``[store] url``): files, batches, every request line
with its result. Under the data directory: ``files/<file id>.jsonl`` (uploads and the output and error
files; with PostgreSQL a copy of what the database holds), ``staging/`` (files being received or built).

Claims: a runner takes the lines it will run with :meth:`BatchStore.claim_lines`, which marks them
with its holder id and a time the claim lasts (``FOR UPDATE SKIP LOCKED`` on PostgreSQL: two replicas
never take the same line), and renews its claims while it runs them. A line whose claim ran out (its
runner died) goes to the next runner that asks. On SQLite one process owns the file: claims left by
the previous process are cleared on open.

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
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import orjson

from proxy.batch.jsonl import FileRefused, line_problems, validate_lines
from proxy.batch.shapes import CANCELLED, EXPIRED, NO_USAGE, Json, Usage, error_line, file_object, new_id, page
from proxy.store.sql import Database, open_database

P = ParamSpec("P")
T = TypeVar("T")

Outcome = Literal["output", "error"]
Ending = Literal["completed", "expired", "cancelled"]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
    seq {serial}, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes {bigint} NOT NULL, created_at {bigint} NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS batches (
    seq {serial}, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, ending TEXT, model TEXT, metadata TEXT, errors TEXT,
    created_at {bigint} NOT NULL, expires_at {bigint} NOT NULL, in_progress_at {bigint},
    finalizing_at {bigint}, completed_at {bigint}, failed_at {bigint}, expired_at {bigint},
    cancelling_at {bigint}, cancelled_at {bigint}, output_file_id TEXT, error_file_id TEXT,
    total {bigint} NOT NULL DEFAULT 0, completed {bigint} NOT NULL DEFAULT 0, failed {bigint} NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx {bigint} NOT NULL, custom_id TEXT, body {blob},
    outcome TEXT, result {blob}, PRIMARY KEY (batch_id, idx)){without_rowid}""",
)

# columns added since the first schema, declared here only: every database, new or made before them,
# gets them on open
_ADDED_COLUMNS = {
    "batches": (
        "input_tokens {bigint} NOT NULL DEFAULT 0",
        "cached_tokens {bigint} NOT NULL DEFAULT 0",
        "output_tokens {bigint} NOT NULL DEFAULT 0",
        "reasoning_tokens {bigint} NOT NULL DEFAULT 0",
    ),
    "lines": ("claimed_by TEXT", "claim_until {real}"),  # the runner that runs the line, until when
}
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS lines_claimed ON lines (claimed_by) WHERE outcome IS NULL",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",  # the runners look for active ones
)
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
class Answered:
    """A line's result to keep (:meth:`BatchStore.record_many`)."""

    batch_id: str
    idx: int
    outcome: Outcome
    line: bytes
    usage: Usage = NO_USAGE


@dataclass(frozen=True, slots=True)
class PendingLine:
    idx: int
    custom_id: str
    body: bytes


def _batch_object(row: Any) -> Json:
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


def _usage_columns(u: Usage) -> tuple[int, int, int, int]:
    return (u.input_tokens, u.cached_tokens, u.output_tokens, u.reasoning_tokens)


def _file_object(row: Any) -> Json:
    return file_object(
        id=row["id"], bytes=row["bytes"], created_at=row["created_at"], filename=row["filename"], purpose=row["purpose"]
    )


class BatchStore:
    """Files, batches and request lines of every owner; each query is scoped to one owner.

    ``url``: the store's database ("" for the embedded SQLite file in ``data_dir``); ``holder``: the
    name this store's claims go by (a fresh one by default)."""

    def __init__(self, data_dir: Path, url: str = "", *, holder: str | None = None) -> None:
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.staging_dir = data_dir / "staging"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        # one thread at a time uses the connection (StoreThread), not always the thread that opened it
        self._db: Database = open_database(url, data_dir, "batches.sqlite3")
        self.shared = self._db.shared  # other replicas run lines of the same batches
        self.holder = holder or new_id("runner-")
        self._db.create(_SCHEMA, _ADDED_COLUMNS, _INDEXES)
        if not self.shared:  # the process that claimed them is gone: this one owns the file now
            with self._transaction() as db:
                db.execute(
                    "UPDATE lines SET claimed_by=NULL, claim_until=NULL WHERE claimed_by IS NOT NULL AND outcome IS NULL"
                )

    @classmethod
    @contextmanager
    def open(cls, data_dir: Path, url: str = "") -> Iterator[BatchStore]:
        store = cls(data_dir, url)
        try:
            yield store
        finally:
            store.close()

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> contextlib.AbstractContextManager[Database]:
        return self._db.transaction()

    def file_path(self, file_id: str) -> Path:
        """Where this replica keeps the file's content (see :meth:`local_file`)."""
        return self.files_dir / f"{file_id}.jsonl"

    def local_file(self, file_id: str) -> Path:
        """The file's content on this replica's disk: fetched from the shared store on first use."""
        path = self.file_path(file_id)
        if self.shared and not path.exists():
            staged = self.staging_dir / f"{path.name}.{new_id('fetch-')}"
            try:
                if self._db.fetch_content(file_id, staged):
                    os.replace(staged, path)
            finally:
                staged.unlink(missing_ok=True)
        return path

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
            db.put_content(file_id, self.file_path(file_id))
        return file_object(id=file_id, bytes=size, created_at=now, filename=filename, purpose=purpose)

    def get_file(self, owner: str, file_id: str) -> Json | None:
        row = self._db.execute("SELECT * FROM files WHERE id=? AND owner=?", (file_id, owner)).fetchone()
        return None if row is None else _file_object(row)

    def list_files(self, owner: str, *, after: str | None, limit: int, ascending: bool, purpose: str | None) -> Json:
        op, order = (">", "ASC") if ascending else ("<", "DESC")
        rows = self._db.execute(
            f"SELECT * FROM files WHERE owner=:owner AND (CAST(:purpose AS TEXT) IS NULL OR purpose=:purpose) "
            f"AND (CAST(:after AS TEXT) IS NULL OR seq {op} (SELECT seq FROM files WHERE id=:after AND owner=:owner)) "
            f"ORDER BY seq {order} LIMIT :n",
            {"owner": owner, "purpose": purpose, "after": after, "n": limit + 1},
        ).fetchall()
        return page([_file_object(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._transaction() as db:
            gone = db.execute("DELETE FROM files WHERE id=? AND owner=?", (file_id, owner)).rowcount == 1
            if gone:
                db.drop_content(file_id)
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
            "AND (CAST(:after AS TEXT) IS NULL OR seq < (SELECT seq FROM batches WHERE id=:after AND owner=:owner)) "
            "ORDER BY seq DESC LIMIT :n",
            {"owner": owner, "after": after, "n": limit + 1},
        ).fetchall()
        return page([_batch_object(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def request_cancel(self, owner: str, batch_id: str, now: int) -> Json | None:
        """``cancelling`` from any unfinished status; a no-op while already cancelling."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT status FROM batches WHERE id=? AND owner=?{for_update}", (batch_id, owner)
            ).fetchone()
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
            with self.local_file(row["input_file_id"]).open("rb") as f:
                checked = validate_lines(f, endpoint=row["endpoint"], accepts_model=accepts_model)
        except FileNotFoundError:
            return self._fail(batch_id, now, [("invalid_file", "the input file was deleted", None)])
        except FileRefused as exc:
            return self._fail(batch_id, now, [(exc.code, exc.message, exc.line)])
        if checked.bad:  # as OpenAI: a batch runs only when every line is a request it can send
            return self._fail(batch_id, now, line_problems(checked.bad))
        with self._transaction() as db:
            if db.execute("SELECT status FROM batches WHERE id=?{for_update}", (batch_id,)).fetchone()["status"] != (
                "validating"
            ):
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

    def claim_lines(self, batch_id: str, *, after: int, limit: int, now: float, claim_s: float) -> list[PendingLine]:
        """Take up to ``limit`` unanswered lines past ``after`` that no other holder's live claim holds,
        in input order, for ``claim_s`` seconds from ``now``; none while the batch is not ``in_progress``.
        This holder's own claims count as free: the caller passes ``after`` to skip the lines it runs."""
        with self._transaction() as db:
            if db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()["status"] != "in_progress":
                return []
            rows = db.execute(
                "UPDATE lines SET claimed_by=:holder, claim_until=:until WHERE batch_id=:batch AND idx IN ("
                "SELECT idx FROM lines WHERE batch_id=:batch AND idx>:after AND outcome IS NULL "
                "AND (claim_until IS NULL OR claim_until<:now OR claimed_by=:holder) ORDER BY idx LIMIT :n{skip_locked}) "
                "RETURNING idx, custom_id, body",
                {
                    "holder": self.holder,
                    "until": now + claim_s,
                    "batch": batch_id,
                    "after": after,
                    "now": now,
                    "n": limit,
                },
            ).fetchall()
        return sorted((PendingLine(r["idx"], r["custom_id"], bytes(r["body"])) for r in rows), key=lambda p: p.idx)

    def renew_claims(self, *, now: float, claim_s: float) -> int:
        """Extend every claim of this store's holder on a line still unanswered; how many."""
        with self._transaction() as db:
            return db.execute(
                "UPDATE lines SET claim_until=? WHERE claimed_by=? AND outcome IS NULL",
                (now + claim_s, self.holder),
            ).rowcount

    def release_claims(self) -> None:
        """Give up this holder's claims on unanswered lines (it stops): another runner takes them at once."""
        with self._transaction() as db:
            db.execute(
                "UPDATE lines SET claimed_by=NULL, claim_until=NULL WHERE claimed_by=? AND outcome IS NULL",
                (self.holder,),
            )

    def unanswered(self, batch_id: str) -> int:
        """How many of the batch's lines have no result yet (claimed or not)."""
        row = self._db.execute("SELECT COUNT(*) AS n FROM lines WHERE batch_id=? AND outcome IS NULL", (batch_id,))
        return int(row.fetchone()["n"])

    def record(self, batch_id: str, idx: int, outcome: Outcome, line: bytes, usage: Usage = NO_USAGE) -> bool:
        """Keep a line's result, and add its answer's usage to the batch's, once: False when the line
        already had one."""
        return self.record_many([Answered(batch_id, idx, outcome, line, usage)])[0]

    def record_many(self, answered: Sequence[Answered]) -> list[bool]:
        """:meth:`record` for several lines in one transaction (one commit, one flush of the log); for
        each, whether it was kept. The lines' rows first, then each batch's once, both in one order:
        two replicas recording at once never wait on each other in a cycle."""
        kept = [False] * len(answered)
        sums: dict[str, list[int]] = {}
        with self._transaction() as db:
            for n in sorted(range(len(answered)), key=lambda n: (answered[n].batch_id, answered[n].idx)):
                a, u = answered[n], answered[n].usage
                kept[n] = (
                    db.execute(
                        "UPDATE lines SET outcome=?, result=? WHERE batch_id=? AND idx=? AND outcome IS NULL",
                        (a.outcome, a.line, a.batch_id, a.idx),
                    ).rowcount
                    == 1
                )
                if kept[n]:
                    added = (a.outcome == "output", a.outcome != "output", *_usage_columns(u))
                    sums[a.batch_id] = [x + y for x, y in zip(sums.get(a.batch_id, [0] * 6), added, strict=True)]
            for batch_id, (completed, failed, *tokens) in sorted(sums.items()):
                db.execute(
                    "UPDATE batches SET completed=completed+?, failed=failed+?, input_tokens=input_tokens+?, "
                    "cached_tokens=cached_tokens+?, output_tokens=output_tokens+?, "
                    "reasoning_tokens=reasoning_tokens+? WHERE id=?",
                    (completed, failed, *tokens, batch_id),
                )
        return kept

    def finish(self, batch_id: str, ending: Ending, now: int) -> None:
        """End a batch: unanswered lines to the error file, the files built, the final status kept."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id=?{for_update}", (batch_id,)).fetchone()
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
                    file_id = f"file-{hex_id}-{outcome}"
                    db.execute(
                        "INSERT INTO files (id, owner, filename, purpose, bytes, created_at) VALUES (?,?,?,?,?,?) "
                        "ON CONFLICT (id) DO UPDATE SET bytes=excluded.bytes, created_at=excluded.created_at",
                        (file_id, row["owner"], f"batch_{hex_id}_{outcome}.jsonl", "batch_output", size, now),
                    )
                    db.put_content(file_id, self.file_path(file_id))
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
        staged = self.staging_dir / f"{path.name}.{new_id('build-')}"  # replicas may build it at once
        size = 0
        with staged.open("wb") as out:
            for row in self._db.execute(
                "SELECT result FROM lines WHERE batch_id=? AND outcome=? ORDER BY idx", (batch_id, outcome)
            ):
                out.write(bytes(row["result"]) + b"\n")
                size += len(row["result"]) + 1
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
    async def open(cls, data_dir: Path, url: str = "") -> AsyncIterator[StoreThread]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store") as executor:
            store = await loop.run_in_executor(executor, BatchStore, data_dir, url)
            try:
                yield cls(store, executor)
            finally:
                await loop.run_in_executor(executor, store.close)

    async def __call__(self, method: Callable[Concatenate[BatchStore, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(method, self.store, *args, **kwargs))
