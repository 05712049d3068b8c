"""The 24h completion window, on the clock the service is given: a batch not done by then ends
``expired``; its answered lines keep their results, the unrun ones go to the error file as OpenAI's
``batch_expired``."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from proxy.batch import BatchRunner, BatchService, NotNow, owner_of
from proxy.batch.store import ActiveBatch, PendingLine
from tests.batch.conftest import CHAT, FakeExecutor, chunks, jsonl, read_lines, request_line, wait_final
from tests.harness.clock import ManualClock
from tests.harness.wait import wait_until

OWNER = owner_of("key-a")
DAY = 24 * 3600
START = 1_700_000_000.0


async def _create(service: BatchService, ids: str) -> str:
    uploaded = await service.upload_file(
        OWNER, filename="in.jsonl", purpose="batch", chunks=chunks(jsonl(*map(request_line, ids)))
    )
    batch = await service.create_batch(OWNER, input_file_id=uploaded["id"], endpoint=CHAT, completion_window="24h")
    assert (batch["created_at"], batch["expires_at"]) == (START, START + DAY)
    return str(batch["id"])


async def test_lines_not_started_within_the_window_expire(tmp_path: Path, store_url: str) -> None:
    clock = ManualClock(START)
    gate = asyncio.Event()
    executor = FakeExecutor(gate=gate)
    async with BatchService.open(tmp_path, executor, concurrency=2, clock=clock, store_url=store_url) as service:
        batch_id = await _create(service, "abcde")
        await wait_until(lambda: executor.started == ["a", "b"], "executor.started == ['a', 'b']", timeout=20)

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


async def test_a_batch_resumed_after_its_window_expires_without_running_again(tmp_path: Path, store_url: str) -> None:
    clock = ManualClock(START)
    gate = asyncio.Event()
    first = FakeExecutor(gate=gate, holds=lambda content: content != "a")
    async with BatchService.open(tmp_path, first, clock=clock, store_url=store_url) as service:
        batch_id = await _create(service, "abc")

        async def a_recorded_the_rest_running() -> bool:
            counts = (await service.get_batch(OWNER, batch_id))["request_counts"]
            return counts["completed"] == 1 and len(first.started) == 3

        await wait_until(a_recorded_the_rest_running, "a recorded, the rest running", timeout=20)

    clock.now = START + DAY + 3600  # down for longer than the window
    second = FakeExecutor()
    async with BatchService.open(tmp_path, second, clock=clock, store_url=store_url) as service:
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
        await wait_until(
            lambda: executor.told >= 3, "executor.told >= 3", timeout=20
        )  # c, told again after each Retry-After; d and e held
        assert executor.started == ["a", "b"]
        clock.now = START + DAY
        batch = await wait_final(service, OWNER, batch_id)
        errors = read_lines(await service.file_content(OWNER, batch["error_file_id"]))
    assert batch["status"] == "expired" and batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(c, "batch_expired") for c in "cde"]


class NotNowOnce(FakeExecutor):
    """Tells the first line "not now" once (its key's limit for ``retry_after_s``)."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__()
        self.retry_after_s = retry_after_s
        self.told = False
        self.at: list[tuple[str, float]] = []  # each line asked, when (the loop's time)

    async def execute(self, endpoint, body, owner, withdraw=None):  # type: ignore[no-untyped-def]
        self.at.append((body["messages"][0]["content"], asyncio.get_running_loop().time()))
        if not self.told:
            self.told = True
            raise NotNow("rate limit", self.retry_after_s)
        return await super().execute(endpoint, body, owner, withdraw)


async def test_a_not_now_holds_the_batch_until_its_retry_after(tmp_path: Path) -> None:
    """The slot the told line gives back is not taken by the next line meanwhile: it would only be
    told "not now" too."""
    executor = NotNowOnce(0.3)
    async with BatchService.open(tmp_path, executor, concurrency=1, clock=ManualClock(START)) as service:
        batch_id = await _create(service, "abc")
        batch = await wait_final(service, OWNER, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    (_, told), *after = executor.at
    assert sorted(line for line, _ in after) == ["a", "b", "c"]
    assert all(when >= told + 0.3 for _, when in after)  # nothing started while the Retry-After ran


async def test_a_line_cancelled_before_it_runs_gives_its_slot_back() -> None:
    """A line's task cancelled before its first step (its TaskGroup aborting as a sibling fails)
    never runs its body: the slot it was started with goes back all the same (a slot lost so stalls
    every batch until the proxy restarts)."""
    runner = BatchRunner(None, FakeExecutor(), concurrency=1, clock=ManualClock(START), accepts_model=lambda m: True)  # type: ignore[arg-type]
    batch = ActiveBatch(id="batch_x", owner=OWNER, endpoint=CHAT, status="in_progress", expires_at=int(START + DAY))
    slot = await runner._next_slot(batch, asyncio.Event())
    assert slot is not None and runner._slots.locked()
    line = PendingLine(idx=0, custom_id="a", body=b"{}")
    task = asyncio.ensure_future(runner._run_line(batch, line, asyncio.Event(), [], slot))
    task.add_done_callback(slot.given_back)  # as the dispatch loop starts a line
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert not runner._slots.locked()
