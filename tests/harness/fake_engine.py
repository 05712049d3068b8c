"""A tiny SGLang-shaped upstream for relay tests: real HTTP on a free port, in-process.

It keeps a server-side queue (``max_running`` slots, the rest wait FIFO), streams one SSE chunk
per token with ``token_delay_s`` between them (given both, ``sim_output_len`` tokens at most
``max_tokens``, finishing "stop" within it and "length" at it; otherwise "length" always), serves ``/metrics`` with the live queue, honours
``/abort_request`` by rid (``answer_aborts``: a whole answer ends with what it wrote, as SGLang 0.5
answers a graceful abort) and records everything it saw. ``fail_next(mode, n)`` injects failures:
``"500"`` (an error answer), ``"400"`` (a refusal in SGLang's ``{"object": "error"}`` shape), ``"reset"`` (connection dropped before any byte),
``"midstream"`` (two chunks, then the connection dies), ``"error_event"`` (two chunks, then SGLang's
error event). ``split_events``: every streamed event is written in two halves a moment apart, so
that the proxy reads it in two pieces (as a worker on another host may send it). ``speaks="vllm"``: its ``/metrics`` page has vLLM's names and it has no
``/abort_request`` (a POST there is recorded in ``not_found`` and answered 404, as vLLM answers it).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import orjson
from aiohttp import web

MODEL = "fake-model"


@dataclass
class FakeEngine:
    max_running: int = 8
    token_delay_s: float = 0.001
    default_tokens: int = 4
    pad: int = 0  # extra characters in every streamed chunk's text (big streams for back-pressure tests)
    emitted: int = 0  # streamed chunks written so far, all requests
    written: int = 0  # tokens of whole answers written so far token by token (``answer_aborts``), all requests
    running: int = 0
    waiting: deque = field(default_factory=deque)
    seen_rids: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    cancelled: list = field(default_factory=list)
    bodies: list = field(default_factory=list)
    answer_aborts: bool = False  # an aborted whole answer ends with what it wrote, finish "abort" (else: cancelled)
    miss_aborts: int = 0  # the next this many aborts find nothing (as one that came before its request)
    speaks: str = "sglang"  # or "vllm": its metrics page and routes
    split_events: bool = False  # each streamed event in two writes, a moment apart (two reads at the proxy)
    not_found: list = field(default_factory=list)  # bodies POSTed to routes it does not have
    _fail: list = field(default_factory=list)
    _ending: set = field(default_factory=set)
    _whole: set = field(default_factory=set)
    _active: dict = field(default_factory=dict)
    runner: web.AppRunner | None = None
    url: str = ""

    def fail_next(self, mode: str, n: int = 1) -> None:
        self._fail.extend([mode] * n)

    def fail_none(self) -> None:
        """Forget the failures still due: every next request is served."""
        self._fail.clear()

    # -- server-side scheduling ---------------------------------------------------------------------
    async def _acquire(self) -> None:
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self.waiting:
                self.waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._release()
            raise

    def set_slots(self, n: int) -> None:
        """Serve ``n`` at once from now on (0 holds every request in the server-side queue)."""
        self.max_running = n
        while self.waiting and self.running < n:
            fut = self.waiting.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)

    def _release(self) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1

    # -- handlers -----------------------------------------------------------------------------------
    async def generate_like(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        rid = body.get("rid")
        self.seen_rids.append(rid)
        mode = self._fail.pop(0) if self._fail else None
        if mode == "500":
            return web.Response(status=500, text="internal failure (injected)")
        if mode == "400":
            refusal = {"object": "error", "message": "n=9 is too large (injected)", "type": "BadRequestError"}
            return web.Response(status=400, body=orjson.dumps({**refusal, "param": None, "code": 400}))
        if mode == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.01)
            return web.Response(status=200)
        n = int(body.get("sim_output_len") or body.get("max_tokens") or self.default_tokens)
        task = asyncio.current_task()
        if rid is not None and task is not None:
            self._active[rid] = task
            if not body.get("stream"):
                self._whole.add(rid)
        try:
            await self._acquire()
            try:
                return await self._emit(request, body, n, mode)
            finally:
                self._release()
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            if rid is not None:
                self._active.pop(rid, None)

    async def _emit(self, request: web.Request, body: dict, n: int, mode: str | None) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        reason = "length"
        cap = body.get("max_tokens")
        if isinstance(body.get("sim_output_len"), int) and isinstance(cap, int):  # the true length, then the cap
            n, reason = min(n, cap), ("stop" if n <= cap else "length")
        if not body.get("stream"):
            if self.answer_aborts:  # token by token: an abort ends it with what it wrote (SGLang 0.5)
                for i in range(n):
                    await asyncio.sleep(self.token_delay_s)
                    self.written += 1
                    if body.get("rid") in self._ending:
                        n, reason = i + 1, "abort"
                        break
            else:
                await asyncio.sleep(self.token_delay_s * n)
            text = "tok " * n
            choice = {"index": 0, "finish_reason": reason}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            self.finished.append(body.get("rid"))
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body.get("model", MODEL),
                    "choices": [choice],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            delta = {"index": 0, "finish_reason": reason if i == n - 1 else None}
            text = f"t{i} " + "x" * self.pad
            delta.update({"delta": {"content": text}} if chat else {"text": text})
            chunk = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": body.get("model", MODEL),
                "choices": [delta],
            }
            await self._send(out, b"data: " + orjson.dumps(chunk) + b"\n\n")
            self.emitted += 1
            if mode == "error_event" and i == 1:  # SGLang's error event in a stream that started
                refusal = {"object": "error", "message": "out of memory (injected)", "type": "InternalServerError"}
                await self._send(out, b"data: " + orjson.dumps({"error": {**refusal, "code": 500}}) + b"\n\n")
                await self._send(out, b"data: [DONE]\n\n")
                return out
            if mode == "midstream" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                raise asyncio.CancelledError
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):  # OpenAI's usage event: no choices
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            chunk = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0, "choices": [], "usage": usage}
            await self._send(out, b"data: " + orjson.dumps(chunk) + b"\n\n")
        await self._send(out, b"data: [DONE]\n\n")
        self.finished.append(body.get("rid"))
        await out.write_eof()
        return out

    async def _send(self, out: web.StreamResponse, event: bytes) -> None:
        if not self.split_events:
            await out.write(event)
            return
        half = len(event) // 2
        await out.write(event[:half])
        await asyncio.sleep(0.02)  # the first half goes out on its own: the proxy reads it alone
        await out.write(event[half:])

    async def abort(self, request: web.Request) -> web.Response:
        if self.speaks == "vllm":
            self.not_found.append(await request.json())
            return web.json_response({"detail": "Not Found"}, status=404)
        rid = (await request.json()).get("rid")
        self.aborted.append(rid)
        if self.miss_aborts > 0:
            self.miss_aborts -= 1
            return web.json_response({})
        if self.answer_aborts and rid in self._whole:
            self._ending.add(rid)  # it answers with what it wrote at its next token
            return web.json_response({})
        task = self._active.get(rid)
        if task is not None:
            task.cancel()
        return web.json_response({})

    async def metrics(self, request: web.Request) -> web.Response:
        q = len(self.waiting)
        if self.speaks == "vllm":
            text = (
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {q}\n'
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {self.running / max(1, self.max_running):.2f}\n'
            )
            return web.Response(text=text, content_type="text/plain")
        text = (
            f'sglang:num_queue_reqs{{model_name="{MODEL}"}} {q}\n'
            f'sglang:num_running_reqs{{model_name="{MODEL}"}} {self.running}\n'
            f'sglang:token_usage{{model_name="{MODEL}"}} {self.running / max(1, self.max_running):.2f}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, self.generate_like)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
