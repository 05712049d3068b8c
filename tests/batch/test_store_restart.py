"""The store's PostgreSQL server restarted under a running batch: the runner rides the outage out on a
new connection, the lines answered while the server was down are kept once it is back, and the batch
ends with each line once (none run twice)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from proxy.batch import BatchService, owner_of
from tests.batch.conftest import CHAT, FakeExecutor, chunks, jsonl, read_lines, request_line, wait_final
from tests.harness.postgres import PostgresServer
from tests.harness.wait import wait_until

pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
OWNER = owner_of("key-a")


async def test_a_batch_carries_on_across_a_restart_of_the_store(tmp_path: Path, own_postgres: PostgresServer) -> None:
    url = own_postgres.create_database("restarted")
    ids = [f"line-{n:02d}" for n in range(12)]
    gate = asyncio.Event()
    executor = FakeExecutor(gate=gate)
    async with contextlib.AsyncExitStack() as stack:
        service = await stack.enter_async_context(
            BatchService.open(tmp_path / "a", executor, concurrency=3, store_url=url, poll_s=0.05)
        )
        uploaded = await service.upload_file(
            OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, ids)))
        )
        batch = await service.create_batch(OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h")
        await wait_until(lambda: len(executor.started) == 3, "three lines running")
        await asyncio.to_thread(own_postgres.stop)
        gate.set()  # the three answer while the server is down: their results wait for it
        await wait_until(lambda: len(executor.finished) == 3, "the three lines answered during the outage")
        assert len(executor.started) == 3  # no line starts before its results can be kept
        await asyncio.to_thread(own_postgres.start)
        ended = await wait_final(service, OWNER, batch["id"])
        output = read_lines(await service.file_content(OWNER, ended["output_file_id"]))

    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == len(ids)
    assert sorted(executor.started) == ids  # each line run once: none lost with the connection, none again
    assert [line["custom_id"] for line in output] == ids
