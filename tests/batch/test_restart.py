"""Exactly once across a restart: a batch stopped half done resumes on the same SQLite file; every line
is answered once, and no line with a recorded result runs again."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from proxy.batch import BatchService, BatchStore, owner_of
from tests.batch.conftest import CHAT, FakeExecutor, chunks, jsonl, read_lines, request_line, wait_final, wait_until

OWNER = owner_of("key-a")
IDS = [f"line-{n}" for n in range(10)]
HELD = set(IDS[5:])  # the second half waits on the gate: in flight when the first service goes away


def _copy_as_killed(src: Path, dst: Path) -> None:
    """The data directory as a SIGKILL leaves it: the database, its write-ahead log (committed
    transactions not yet checkpointed) and the files; not the shared-memory index SQLite rebuilds."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*-shm"))


@pytest.mark.parametrize("stop", ["killed", "closed"])
async def test_a_batch_resumes_where_its_results_stand(tmp_path: Path, stop: str) -> None:
    first_dir = tmp_path / "first"
    resumed_dir = tmp_path / "resumed" if stop == "killed" else first_dir
    gate = asyncio.Event()
    first = FakeExecutor(gate=gate, holds=HELD.__contains__)
    async with BatchService.open(first_dir, first, concurrency=len(IDS)) as service:
        uploaded = await service.upload_file(
            OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, IDS)))
        )
        batch = await service.create_batch(OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h")

        async def half_recorded() -> bool:
            counts = (await service.get_batch(OWNER, batch["id"]))["request_counts"]
            return counts["completed"] == 5 and len(first.started) == len(IDS)

        await wait_until(half_recorded)
        if stop == "killed":
            _copy_as_killed(first_dir, resumed_dir)
    assert sorted(first.finished) == IDS[:5]  # the held lines never answered: they were cancelled

    second = FakeExecutor()
    async with BatchService.open(resumed_dir, second) as service:
        assert (await service.get_batch(OWNER, batch["id"]))["request_counts"]["completed"] == 5
        ended = await wait_final(service, OWNER, batch["id"])
        assert ended["status"] == "completed" and ended["error_file_id"] is None
        assert ended["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
        output = read_lines(await service.file_content(OWNER, ended["output_file_id"]))

    assert [line["custom_id"] for line in output] == IDS  # each exactly once, in input order
    assert sorted(second.started) == sorted(HELD)  # a line whose result was recorded never ran again


def test_a_late_duplicate_result_is_dropped(tmp_path: Path) -> None:
    with BatchStore.open(tmp_path) as store:
        staged = store.staging_dir / "in.part"
        staged.write_bytes(jsonl(request_line("a")))
        file_id = store.add_file(OWNER, staged=staged, filename="in.jsonl", purpose="batch", now=0)["id"]
        batch_id = store.create_batch(
            OWNER, input_file_id=file_id, endpoint=CHAT, metadata=None, now=0, window_s=86400
        )["id"]
        assert store.validate(batch_id, accepts_model=lambda _m: True, now=0) == "in_progress"
        [line] = store.pending_lines(batch_id, after=0, limit=10)

        assert store.record(batch_id, line.idx, "output", b'{"first": true}')
        assert not store.record(batch_id, line.idx, "error", b'{"second": true}')
        assert store.pending_lines(batch_id, after=0, limit=10) == []
        assert store.get_batch(OWNER, batch_id)["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
