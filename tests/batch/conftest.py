"""Helpers for the Batch API's tests: request lines, a fake executor, waiting for a batch to end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson

from proxy.batch import BatchService, LineResult
from proxy.batch.shapes import Json

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


def request_line(custom_id: str, *, model: str = "m", url: str = CHAT, **extra: Any) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": custom_id}], **extra}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def jsonl(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in lines)


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


class FakeExecutor:
    """Answers 200 with the request's content echoed; ``gate`` holds every line until set.

    ``status_of(content) -> status code`` picks other answers.
    """

    def __init__(
        self, *, gate: asyncio.Event | None = None, status_of: Callable[[str], int] = lambda _content: 200
    ) -> None:
        self.gate = gate
        self.status_of = status_of
        self.started: list[str] = []
        self.owners: set[str] = set()

    async def execute(self, endpoint: str, body: dict[str, Any], owner: str) -> LineResult:
        content = body["messages"][0]["content"]
        self.started.append(content)
        self.owners.add(owner)
        if self.gate is not None:
            await self.gate.wait()
        status = self.status_of(content)
        answer = {
            "id": f"chatcmpl-{content}",
            "object": "chat.completion",
            "endpoint": endpoint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        }
        if status != 200:
            answer = {"error": {"message": "refused", "type": "invalid_request_error", "param": None, "code": None}}
        return LineResult(status, orjson.dumps(answer), f"req-{content}")


async def wait_until(check: Callable[[], Any], *, timeout: float = 20.0) -> None:
    """Poll ``check`` (sync or async) until it is true; fails the test past ``timeout``."""
    async with asyncio.timeout(timeout):
        while True:
            done = check()
            if asyncio.iscoroutine(done):
                done = await done
            if done:
                return
            await asyncio.sleep(0.005)


async def wait_final(service: BatchService, owner: str, batch_id: str) -> Json:
    batch: Json = {}

    async def ended() -> bool:
        nonlocal batch
        batch = await service.get_batch(owner, batch_id)
        return batch["status"] in FINAL

    await wait_until(ended)
    return batch


def read_lines(path: Path) -> list[Json]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]
