"""aiohttp handlers of ``/v1/files`` and ``/v1/batches`` in OpenAI's shapes.

:func:`add_routes` registers them; the handlers find the :class:`BatchService` under
:data:`BATCH_SERVICE` in the app (put there by whoever owns its lifecycle) and learn the caller's API
key from ``authenticate`` (which refuses a caller by raising :class:`~proxy.errors.ApiError`). Every
refusal is answered here with an OpenAI error body.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
from aiohttp import BodyPartReader, web

from proxy.batch.service import BatchService, owner_of
from proxy.batch.shapes import Json
from proxy.errors import ApiError, bad_request, body_deadline, error_response

BATCH_SERVICE = web.AppKey("batch_service", BatchService)

Authenticate = Callable[[web.Request], str]
"""The caller's API key; raises ApiError (401) to refuse the request."""

_Handler = Callable[[web.Request, BatchService, str], Awaitable[web.StreamResponse]]


def bearer_key(request: web.Request) -> str:
    """The bearer token as sent, ``""`` without one (an open proxy: every caller is the same owner)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _json(data: Json) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", param=name) from None


async def _part_chunks(part: BodyPartReader, timeout_s: float) -> AsyncIterator[bytes]:
    """A part's chunks, each within ``timeout_s`` (an upload may take long; a stalled one is cut off)."""
    while True:
        async with body_deadline(timeout_s):
            chunk = await part.read_chunk(1 << 16)
        if not chunk:
            return
        yield chunk


async def upload_file(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    if not request.content_type.startswith("multipart/"):
        raise bad_request("upload a file as multipart/form-data with the fields 'purpose' and 'file'")
    reader = await request.multipart()
    purpose: str | None = None
    filename = "upload.jsonl"
    async with contextlib.AsyncExitStack() as received:
        staged: Path | None = None
        while True:
            async with body_deadline(service.body_timeout_s):
                part = await reader.next()
            if part is None:
                break
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                async with body_deadline(service.body_timeout_s):
                    purpose = (await part.text()).strip()
                service.check_purpose(purpose)
            elif part.name == "file" and staged is None:  # the fields in any order, as a form may send them
                filename = part.filename or filename
                staged = await received.enter_async_context(
                    service.receiving(_part_chunks(part, service.body_timeout_s))
                )
            elif part.name == "file":
                raise bad_request("the upload has more than one 'file' field", param="file")
            else:
                async with body_deadline(service.body_timeout_s):
                    await part.release()
        if staged is None:
            raise bad_request("the upload has no 'file' field", param="file")
        if purpose is None:
            raise bad_request("the upload has no 'purpose' field", param="purpose")
        return _json(await service.add_upload(owner, staged, filename=filename, purpose=purpose))


async def list_files(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    q = request.query
    return _json(
        await service.list_files(
            owner,
            after=q.get("after"),
            limit=_int_query(request, "limit", 10_000),
            order=q.get("order", "desc"),
            purpose=q.get("purpose"),
        )
    )


async def get_file(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    return _json(await service.get_file(owner, request.match_info["file_id"]))


async def file_content(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    path = await service.file_content(owner, request.match_info["file_id"])
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    return _json(await service.delete_file(owner, request.match_info["file_id"]))


async def create_batch(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    try:
        async with body_deadline(service.body_timeout_s):
            raw = await request.read()
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return _json(
        await service.create_batch(
            owner,
            input_file_id=body.get("input_file_id"),
            endpoint=body.get("endpoint"),
            completion_window=body.get("completion_window"),
            metadata=body.get("metadata"),
        )
    )


async def list_batches(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    return _json(
        await service.list_batches(owner, after=request.query.get("after"), limit=_int_query(request, "limit", 20))
    )


async def get_batch(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    return _json(await service.get_batch(owner, request.match_info["batch_id"]))


async def cancel_batch(request: web.Request, service: BatchService, owner: str) -> web.StreamResponse:
    return _json(await service.cancel_batch(owner, request.match_info["batch_id"]))


ROUTES: tuple[tuple[str, str, _Handler], ...] = (
    ("POST", "/v1/files", upload_file),
    ("GET", "/v1/files", list_files),
    ("GET", "/v1/files/{file_id}", get_file),
    ("GET", "/v1/files/{file_id}/content", file_content),
    ("DELETE", "/v1/files/{file_id}", delete_file),
    ("POST", "/v1/batches", create_batch),
    ("GET", "/v1/batches", list_batches),
    ("GET", "/v1/batches/{batch_id}", get_batch),
    ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch),
)


def _bind(handler: _Handler, authenticate: Authenticate) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            owner = owner_of(authenticate(request))
            return await handler(request, request.app[BATCH_SERVICE], owner)
        except ApiError as err:
            return error_response(err)

    return handle


def add_routes(app: web.Application, *, authenticate: Authenticate = bearer_key) -> None:
    """Register the Files and Batches endpoints; ``app[BATCH_SERVICE]`` must be set before they serve."""
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, _bind(handler, authenticate))
