"""Several replicas on one PostgreSQL store (``[store] url``): each line of a batch runs on one of them
and is answered exactly once; a replica killed mid-batch leaves its lines to another after their claims
run out, and the other finishes the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest

from proxy.batch import BatchService, owner_of
from proxy.batch.runner import CLAIM_S
from proxy.workers.supervisor import free_port
from tests.batch.conftest import (
    CHAT,
    FakeExecutor,
    chunks,
    content_lines,
    jsonl,
    read_lines,
    request_line,
    wait_final,
    wait_final_over_http,
)
from tests.batch.test_sigkill import MODEL, POLICY, _client, _process, _ready, _serve
from tests.harness.wait import wait_until

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
OWNER = owner_of("key-a")


async def test_two_runners_share_a_batch_each_line_on_one_of_them(tmp_path: Path, postgres_url: str) -> None:
    ids = [f"line-{n:02d}" for n in range(12)]
    gate = asyncio.Event()
    first, second = FakeExecutor(gate=gate), FakeExecutor(gate=gate)
    async with contextlib.AsyncExitStack() as stack:
        services = [
            await stack.enter_async_context(
                BatchService.open(tmp_path / name, executor, concurrency=3, store_url=postgres_url, poll_s=0.05)
            )
            for name, executor in (("a", first), ("b", second))
        ]
        uploaded = await services[0].upload_file(
            OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, ids)))
        )
        batch = await services[0].create_batch(
            OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h"
        )
        await wait_until(lambda: first.started and second.started, "both runners running lines of the batch")
        gate.set()
        ended = await wait_final(services[1], OWNER, batch["id"])
        output = read_lines(await services[1].file_content(OWNER, ended["output_file_id"]))

    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == len(ids)
    assert not set(first.started) & set(second.started)  # no line ran on both
    assert sorted(first.started + second.started) == ids
    assert [line["custom_id"] for line in output] == ids  # each exactly once, in input order


def _holders(url: str) -> int:
    """How many runners have answered lines (the holder of each answered line's last claim)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT COUNT(DISTINCT claimed_by) FROM lines WHERE outcome IS NOT NULL").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.long
async def test_a_replica_killed_mid_batch_leaves_it_to_the_other(tmp_path: Path, postgres_url: str) -> None:
    lines_n = 40
    worker_port = free_port("127.0.0.1")
    sim = [sys.executable, "-m", "proxy", "sim", "--port", str(worker_port), "--max-running-requests", "8"]
    sim += ["--sim-time-scale", "2", "--sim-startup-seconds", "0.2"]
    policy = POLICY.format(worker=f"http://127.0.0.1:{worker_port}")
    policy += f'[store]\nurl = "{postgres_url}"\n'  # the claims as shipped: the killed one's lines wait CLAIM_S
    ids = [f"line-{n:02d}" for n in range(lines_n)]
    lines = [request_line(i, model=MODEL, max_tokens=64, sim_output_len=64) for i in ids]
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
        (folder / "policy.toml").write_text(policy)

    with _process(sim, tmp_path, tmp_path / "worker.log"):
        (argv_a, url_a), (argv_b, url_b) = _serve(), _serve()
        with (
            _process(argv_a, folders[0], folders[0] / "pacer.log") as doomed,
            _process(argv_b, folders[1], folders[1] / "pacer.log"),
        ):
            await _ready(url_a, folders[0] / "pacer.log")
            await _ready(url_b, folders[1] / "pacer.log")
            async with _client(url_a) as client:
                uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
                created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
            await wait_until(lambda: _holders(postgres_url) >= 2, "both replicas answering lines", timeout=60)
            doomed.kill()
            doomed.wait()
            async with _client(url_b) as client:
                found = await client.batches.retrieve(created.id)
                batch = await wait_final_over_http(client, created.id, timeout=CLAIM_S + 20)
                output = await content_lines(client, batch.output_file_id)

    assert found.request_counts is not None and found.request_counts.completed < lines_n  # killed mid-batch
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts.completed == lines_n
    assert [line["custom_id"] for line in output] == ids  # each exactly once, in input order
    assert all(line["response"]["status_code"] == 200 for line in output)
