"""Generation endpoints: native ``/generate`` and OpenAI ``/v1/completions``, ``/v1/chat/completions``.

Non-streaming handlers wait for the request to finish; streaming ones write one SSE chunk per token
(native chunks carry the cumulative text, as SGLang's default). A client that goes away aborts its
request in the engine. Errors use SGLang's shapes: ``{"error": {"message"}}`` on the native
endpoint, ``{"object": "error", "message", "type", "param", "code"}`` on the OpenAI ones, and
``{"detail": "The request queue is full."}`` with 503 past ``--max-queued-requests``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.sim.driver import Driver
from proxy.sim.engine import QueueFull
from proxy.sim.protocol import BadRequest, GenParams, parse_chat, parse_completion, parse_generate
from proxy.sim.request import Req, State
from proxy.sim.tokenizer import output_text, output_token_ids

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _lead(text: str, p: GenParams) -> str:
    """An answer's first text: a continuation's first word follows the words before it (a space)."""
    return " " + text if p.continues and text else text


def _stream_error(message: str, status: int, err_type: str) -> bytes:
    """An error sent as a stream's only event (the status line has gone already), then the end."""
    err = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return b"data: " + orjson.dumps({"error": err}) + b"\n\ndata: [DONE]\n\n"


@dataclass(frozen=True)
class _OpenAIChunks:
    """The server-sent events of one OpenAI stream, chat or text completion, as SGLang frames them."""

    rid: str
    chat: bool
    model: str
    created: int

    def frame(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        """One event: a chunk holding ``choice`` (none when empty) and ``usage``."""
        body = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
            "usage": usage,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def opening(self) -> bytes:
        """A chat stream's first event: the assistant's role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        return self.frame({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def piece(self, text: str) -> bytes:
        """One token's text."""
        if self.chat:
            return self.frame({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
        return self.frame({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def final(self, finish: str | None, matched: Any) -> bytes:
        """The event that says why the answer ended."""
        content: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return self.frame(choice)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    return json_response(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status
    )


def native_error(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status)


class Generation:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.engine = driver.engine
        self.cfg = driver.cfg

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=orjson.loads)
        except ValueError as exc:
            raise BadRequest(f"The request body is not valid JSON: {exc}") from None

    def _check_ready(self) -> None:
        if not self.driver.ready:
            raise BadRequest("The server is starting up; retry when /health returns 200.", 503)

    @staticmethod
    def meta(r: Req, n: int, final: bool = True) -> dict[str, Any]:
        """``meta_info`` after ``n`` tokens; ``final`` carries the finish reason (None while streaming)."""
        reason = r.finish_reason if final else None
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": r.prompt_len,
            "completion_tokens": n,
            "cached_tokens": r.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "num_retractions": r.num_retractions,
        }
        if reason is not None:
            meta["e2e_latency"] = (r.finish_time or 0.0) - r.arrival
        return meta

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            self._check_ready()
            params, batch = parse_generate(await self._read_json(request), self.cfg)
        except BadRequest as exc:
            return native_error(exc.message, exc.status)
        if params[0].stream:
            return await self._generate_stream(request, params[0])
        try:
            reqs = [self.driver.submit(p) for p in params]
        except QueueFull as exc:
            return json_response({"detail": exc.message}, 503)
        await asyncio.gather(*(self.driver.run_to_end(r) for r in reqs))
        outs = []
        for r in reqs:
            if (
                r.finish_reason
                and r.finish_reason.get("type") == "abort"
                and r.finish_reason.get("status_code", 0) >= 500
            ):
                return json_response({"detail": r.finish_reason["message"]}, int(r.finish_reason["status_code"]))
            n = r.out_base
            outs.append(
                {
                    "text": output_text(r.token_seed, 0, n),
                    "output_ids": output_token_ids(r.token_seed, 0, n),
                    "meta_info": self.meta(r, n),
                }
            )
        return json_response(outs if batch else outs[0])

    async def _generate_stream(self, request: web.Request, p: GenParams) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            r = self.driver.submit(p)
        except QueueFull as exc:
            await resp.write(
                b"data: "
                + orjson.dumps(
                    {"error": {"message": exc.message, "type": "invalid_request_error", "code": 503, "retryable": True}}
                )
                + b"\n\ndata: [DONE]\n\n"
            )
            return resp
        sent, text, closed = 0, "", False
        try:
            while True:
                n = self.engine.output_len(r)
                finished = r.state is State.FINISHED
                while sent < n:  # one chunk per token, cumulative text
                    text += output_text(r.token_seed, sent, sent + 1)
                    sent += 1
                    closed = finished and sent == n
                    meta = self.meta(r, sent, final=closed)
                    await resp.write(b"data: " + orjson.dumps({"text": text, "meta_info": meta}) + b"\n\n")
                if finished:
                    if not closed:  # every token went out before it finished: the reason needs a chunk
                        await resp.write(
                            b"data: " + orjson.dumps({"text": text, "meta_info": self.meta(r, n)}) + b"\n\n"
                        )
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                await self.driver.wait(r, seen=sent)
        finally:
            if r.state is not State.FINISHED:
                self.driver.abort(r, "The client disconnected.")

    def _usage(self, reqs: list[Req]) -> dict[str, Any]:
        prompt = sum(r.prompt_len for r in reqs)
        completion = sum(r.out_base for r in reqs)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }
        if self.cfg.enable_cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(r.cached_tokens for r in reqs)}
        return usage

    @staticmethod
    def _openai_finish(r: Req) -> tuple[str | None, Any]:
        reason = r.finish_reason or {}
        kind = reason.get("type")
        if kind == "stop":
            return "stop", reason.get("matched")
        if kind == "length":
            return "length", None
        return ("abort" if kind == "abort" else None), None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            self._check_ready()
            body = await self._read_json(request)
            params = [parse_chat(body, self.cfg)] if chat else parse_completion(body, self.cfg)
        except BadRequest as exc:
            return openai_error(
                exc.message, exc.status, "BadRequestError" if exc.status < 500 else "ServiceUnavailableError"
            )
        model = body.get("model") or self.cfg.served_model_name
        if params[0].stream:
            return await self._openai_stream(request, params[0], chat=chat, model=model)
        try:
            reqs = [self.driver.submit(p) for p in params]
        except QueueFull as exc:
            return openai_error(exc.message, 503, "ServiceUnavailableError")
        await asyncio.gather(*(self.driver.run_to_end(r) for r in reqs))
        for r in reqs:
            reason = r.finish_reason or {}
            if reason.get("type") == "abort" and reason.get("status_code", 0) >= 500:
                return openai_error(str(reason.get("message")), int(reason["status_code"]), "InternalServerError")
        choices = []
        for i, (r, p) in enumerate(zip(reqs, params, strict=True)):
            finish, matched = self._openai_finish(r)
            text = _lead(output_text(r.token_seed, 0, r.out_base), p)
            if chat:
                choices.append(
                    {
                        "index": i,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "reasoning_content": None,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "matched_stop": matched,
                    }
                )
            else:
                choices.append(
                    {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
                )
        return json_response(
            {
                "id": reqs[0].rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": self._usage(reqs),
            }
        )

    async def _openai_stream(self, request: web.Request, p: GenParams, *, chat: bool, model: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            r = self.driver.submit(p)
        except QueueFull as exc:
            await resp.write(_stream_error(exc.message, 503, "ServiceUnavailableError"))
            return resp
        chunks = _OpenAIChunks(rid=r.rid, chat=chat, model=model, created=int(time.time()))
        sent = 0
        try:
            if chat:
                await resp.write(chunks.opening())
            while True:
                n = self.engine.output_len(r)
                finished = r.state is State.FINISHED
                while sent < n:
                    piece = (
                        output_text(r.token_seed, sent, sent + 1) if sent else _lead(output_text(r.token_seed, 0, 1), p)
                    )
                    sent += 1
                    await resp.write(chunks.piece(piece))
                if finished:
                    await resp.write(chunks.final(*self._openai_finish(r)))
                    if p.include_usage:
                        await resp.write(chunks.frame({}, self._usage([r])))
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                await self.driver.wait(r, seen=sent)
        finally:
            if r.state is not State.FINISHED:
                self.driver.abort(r, "The client disconnected.")
