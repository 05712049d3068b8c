"""The 24h completion window, on the clock the service is given: a batch not done by then ends
``expired``; its answered lines keep their results, the unrun ones go to the error file as OpenAI's
``batch_expired``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.batch import BatchService, NotNow, owner_of
from tests.batch.conftest import CHAT, FakeExecutor, chunks, jsonl, read_lines, request_line, wait_final, wait_until

OWNER = owner_of("key-a")
DAY = 24 * 3600
START = 1_700_000_000.0


class ManualClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _create(service: BatchService, ids: str) -> str:
    uploaded = await service.upload_file(
        OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, ids)))
    )
    batch = await service.create_batch(OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h")
    assert (batch["created_at"], batch["expires_at"]) == (START, START + DAY)
    return str(batch["id"])


async def test_lines_not_started_within_the_window_expire(tmp_path: Path) -> None:
    clock = ManualClock(START)
    gate = asyncio.Event()
    executor = FakeExecutor(gate=gate)
    async with BatchService.open(tmp_path, executor, concurrency=2, clock=clock) as service:
        batch_id = await _create(service, "abcde")
        await wait_until(lambda: executor.started == ["a", "b"])

        clock.now = START + DAY - 1
        assert (await service.get_batch(OWNER, batch_id))["status"] == "in_progress"
        clock.now = START + DAY
        gate.set()
        batch = await wait_final(service, OWNER, batch_id)

        assert batch["status"] == "expired" and batch["expired_at"] == START + DAY
        assert batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
        assert executor.started == ["a", "b"]
        output = read_lines(await service.file_content(OWNER, batch["output_file_id"]))
        errors = read_lines(await service.file_content(OWNER, batch["error_file_id"]))
    assert [line["custom_id"] for line in output] == ["a", "b"]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        (c, None, "batch_expired") for c in "cde"
    ]
    assert all("completion window expired" in e["error"]["message"] for e in errors)


async def test_a_batch_resumed_after_its_window_expires_without_running_again(tmp_path: Path) -> None:
    clock = ManualClock(START)
    gate = asyncio.Event()
    first = FakeExecutor(gate=gate, holds=lambda content: content != "a")
    async with BatchService.open(tmp_path, first, clock=clock) as service:
        batch_id = await _create(service, "abc")

        async def a_recorded_the_rest_running() -> bool:
            counts = (await service.get_batch(OWNER, batch_id))["request_counts"]
            return counts["completed"] == 1 and len(first.started) == 3

        await wait_until(a_recorded_the_rest_running)

    clock.now = START + DAY + 3600  # down for longer than the window
    second = FakeExecutor()
    async with BatchService.open(tmp_path, second, clock=clock) as service:
        batch = await wait_final(service, OWNER, batch_id)
        errors = read_lines(await service.file_content(OWNER, batch["error_file_id"]))
        output = read_lines(await service.file_content(OWNER, batch["output_file_id"]))
    assert batch["status"] == "expired" and second.started == []
    assert [line["custom_id"] for line in output] == ["a"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("b", "batch_expired"), ("c", "batch_expired")]


class RateLimited(FakeExecutor):
    """Tells the lines ``refused`` picks "not now" (their key at its limit) every time."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused
        self.told = 0

    async def execute(self, endpoint, body, owner, withdraw=None):  # type: ignore[no-untyped-def]
        if body["messages"][0]["content"] in self.refused:
            self.told += 1
            raise NotNow("rate limit", 0.05)
        return await super().execute(endpoint, body, owner, withdraw)


async def test_a_line_waiting_out_a_not_now_past_the_window_expires(tmp_path: Path) -> None:
    """A "not now" holds the batch's next lines until its Retry-After; the window running out
    meanwhile ends the batch ``expired``, the waiting line and those after it in the error file."""
    clock = ManualClock(START)
    executor = RateLimited("cde")
    async with BatchService.open(tmp_path, executor, concurrency=1, clock=clock) as service:
        batch_id = await _create(service, "abcde")
        await wait_until(lambda: executor.told >= 3)  # c, told again after each Retry-After; d and e held
        assert executor.started == ["a", "b"]
        clock.now = START + DAY
        batch = await wait_final(service, OWNER, batch_id)
        errors = read_lines(await service.file_content(OWNER, batch["error_file_id"]))
    assert batch["status"] == "expired" and batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(c, "batch_expired") for c in "cde"]
