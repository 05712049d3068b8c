"""Helpers for the Batch API's tests: request lines, a fake executor, waiting for a batch to end, and the
batch routes served on a free port (:func:`serve_batches`) for the ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import orjson
from aiohttp import web

from proxy.batch import BATCH_SERVICE, BatchService, LineResult, add_routes
from proxy.batch.shapes import Json
from tests.harness.wait import wait_until

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
    """Answers 200 with the request's content echoed; ``gate`` holds the lines ``holds`` picks (every
    line by default) until set.

    ``status_of(content) -> status code`` picks other answers. ``started`` lists the content of every
    line it was asked to run, ``finished`` of every line it answered.
    """

    def __init__(
        self,
        *,
        gate: asyncio.Event | None = None,
        holds: Callable[[str], bool] = lambda _content: True,
        status_of: Callable[[str], int] = lambda _content: 200,
    ) -> None:
        self.gate = gate
        self.holds = holds
        self.status_of = status_of
        self.started: list[str] = []
        self.finished: list[str] = []
        self.owners: set[str] = set()

    async def execute(
        self, endpoint: str, body: dict[str, Any], owner: str, withdraw: asyncio.Event | None = None
    ) -> LineResult:
        content = body["messages"][0]["content"]
        self.started.append(content)
        self.owners.add(owner)
        if self.gate is not None and self.holds(content):
            await self.gate.wait()
        self.finished.append(content)
        status = self.status_of(content)
        answer = {
            "id": f"chatcmpl-{content}",
            "object": "chat.completion",
            "endpoint": endpoint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": len(content),
                "total_tokens": 10 + len(content),
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 1},
            },
        }
        if status != 200:
            answer = {"error": {"message": "refused", "type": "invalid_request_error", "param": None, "code": None}}
        return LineResult(status, orjson.dumps(answer), f"req-{content}")


async def wait_final(service: BatchService, owner: str, batch_id: str) -> Json:
    batch: Json = {}

    async def ended() -> bool:
        nonlocal batch
        batch = await service.get_batch(owner, batch_id)
        return batch["status"] in FINAL

    await wait_until(ended, "the batch in a final status", timeout=20)
    return batch


def read_lines(path: Path) -> list[Json]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@dataclass(frozen=True)
class Served:
    """The batch routes of one :class:`BatchService` on a real port."""

    url: str
    service: BatchService

    def client(self, api_key: str = "key-a") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)


@contextlib.asynccontextmanager
async def serve_batches(
    data_dir: Path,
    executor: FakeExecutor,
    *,
    concurrency: int = 256,
    clock: Callable[[], float] = time.time,
    body_timeout_s: float = 60.0,
    store_url: str = "",
) -> AsyncIterator[Served]:
    """A small aiohttp app with only the batch routes, on a free port of 127.0.0.1; stopped on exit."""
    async with BatchService.open(
        data_dir, executor, concurrency=concurrency, clock=clock, body_timeout_s=body_timeout_s, store_url=store_url
    ) as service:
        app = web.Application()
        add_routes(app)
        app[BATCH_SERVICE] = service
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield Served(f"http://127.0.0.1:{runner.addresses[0][1]}", service)
        finally:
            await runner.cleanup()


async def wait_final_over_http(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 20) -> Any:
    """Poll ``batches.retrieve`` until the batch ends (within ``timeout`` seconds); the openai ``Batch``."""
    batch: Any = None

    async def ended() -> bool:
        nonlocal batch
        batch = await client.batches.retrieve(batch_id)
        return batch.status in FINAL

    await wait_until(ended, "the batch in a final status", timeout=timeout)
    return batch


async def content_lines(client: openai.AsyncOpenAI, file_id: str) -> list[Json]:
    return [orjson.loads(line) for line in (await client.files.content(file_id)).content.splitlines()]
