"""Exactly once across a restart: a batch stopped half done resumes on the same store (the SQLite file,
or the PostgreSQL database from another data directory: another replica); every line is answered
once, and no line with a recorded result runs again."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from proxy.batch import BatchService, BatchStore, owner_of
from proxy.batch.shapes import Usage
from tests.batch.conftest import CHAT, FakeExecutor, chunks, jsonl, read_lines, request_line, wait_final
from tests.harness.wait import wait_until

OWNER = owner_of("key-a")
IDS = [f"line-{n}" for n in range(10)]
HELD = set(IDS[5:])  # the second half waits on the gate: in flight when the first service goes away


def _copy_as_killed(src: Path, dst: Path) -> None:
    """The data directory as a SIGKILL leaves it: the database, its write-ahead log (committed
    transactions not yet checkpointed) and the files; not the shared-memory index SQLite rebuilds."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*-shm"))


@pytest.mark.parametrize("stop", ["killed", "closed"])
async def test_a_batch_resumes_where_its_results_stand(tmp_path: Path, stop: str, store_url: str) -> None:
    first_dir = tmp_path / "first"
    resumed_dir = tmp_path / "resumed" if stop == "killed" else first_dir
    gate = asyncio.Event()
    first = FakeExecutor(gate=gate, holds=HELD.__contains__)
    async with BatchService.open(first_dir, first, concurrency=len(IDS), store_url=store_url) as service:
        uploaded = await service.upload_file(
            OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, IDS)))
        )
        batch = await service.create_batch(OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h")

        async def half_recorded() -> bool:
            counts = (await service.get_batch(OWNER, batch["id"]))["request_counts"]
            return counts["completed"] == 5 and len(first.started) == len(IDS)

        await wait_until(half_recorded, "five lines recorded, all started", timeout=20)
        if stop == "killed":
            _copy_as_killed(first_dir, resumed_dir)
    assert sorted(first.finished) == IDS[:5]  # the held lines never answered: they were cancelled

    second = FakeExecutor()
    async with BatchService.open(resumed_dir, second, store_url=store_url) as service:
        assert (await service.get_batch(OWNER, batch["id"]))["request_counts"]["completed"] == 5
        ended = await wait_final(service, OWNER, batch["id"])
        assert ended["status"] == "completed" and ended["error_file_id"] is None
        assert ended["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
        assert ended["usage"]["output_tokens"] == sum(map(len, IDS))  # each line's usage counted once
        output = read_lines(await service.file_content(OWNER, ended["output_file_id"]))

    assert [line["custom_id"] for line in output] == IDS  # each exactly once, in input order
    assert sorted(second.started) == sorted(HELD)  # a line whose result was recorded never ran again


def test_a_late_duplicate_result_is_dropped(tmp_path: Path, store_url: str) -> None:
    with BatchStore.open(tmp_path, store_url) as store:
        staged = store.staging_dir / "in.part"
        staged.write_bytes(jsonl(request_line("a")))
        file_id = store.add_file(OWNER, staged=staged, filename="in.jsonl", purpose="batch", now=0)["id"]
        batch_id = store.create_batch(
            OWNER, input_file_id=file_id, endpoint=CHAT, metadata=None, now=0, window_s=86400
        )["id"]
        assert store.validate(batch_id, accepts_model=lambda _m: True, now=0) == "in_progress"
        [line] = store.pending_lines(batch_id, after=0, limit=10)

        assert store.record(batch_id, line.idx, "output", b'{"first": true}', Usage(input_tokens=7, output_tokens=3))
        assert not store.record(batch_id, line.idx, "error", b'{"second": true}', Usage(input_tokens=7))
        assert store.pending_lines(batch_id, after=0, limit=10) == []
        ended = store.get_batch(OWNER, batch_id)
        assert ended["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        assert (ended["usage"]["input_tokens"], ended["usage"]["total_tokens"]) == (7, 10)


def test_a_database_from_before_the_usage_columns_gets_them(tmp_path: Path) -> None:
    """A batch directory kept from an earlier version opens: the columns added since come with zeros."""
    with closing(sqlite3.connect(tmp_path / "batches.sqlite3")) as old:
        old.executescript(
            "CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, "
            "owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, "
            "completion_window TEXT NOT NULL, status TEXT NOT NULL, ending TEXT, model TEXT, metadata TEXT, "
            "errors TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, "
            "finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, "
            "cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, "
            "total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);"
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
            f"expires_at, total, completed) VALUES ('batch_old', '{OWNER}', '{CHAT}', 'file-x', '24h', 'completed', "
            "0, 86400, 3, 3);"
        )
    with BatchStore.open(tmp_path) as store:
        kept = store.get_batch(OWNER, "batch_old")
        assert kept is not None and kept["request_counts"]["completed"] == 3
        assert kept["usage"]["total_tokens"] == 0
