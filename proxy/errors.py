"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every refusal the proxy makes goes through :func:`error_response` (or :func:`error_event` inside a
stream that already started), so a client always gets a JSON body that names the problem::

    ApiError                       status  type
    ├── bad input (validation)     400     invalid_request_error
    ├── body too large             413     invalid_request_error
    ├── missing / wrong API key    401     authentication_error
    ├── unknown model              404     invalid_request_error, code model_not_found
    ├── no model, several pools    400     invalid_request_error, code model_required
    ├── proxy queue full           429     rate_limit_error (+ Retry-After)
    ├── queue timeout / no worker  503     service_unavailable
    ├── upstream failed            502     upstream_error
    └── upstream too slow          504     upstream_timeout

A worker's own refusal (SGLang's ``{"object": "error", "message", ...}``, vLLM's or a native
``{"error": {"message"}}``, FastAPI's ``{"detail": ...}``, plain text) is re-shaped by
:func:`openai_error_body`: same status, the worker's message kept, ``type`` from the status when the
worker's is not one of OpenAI's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

import orjson
from aiohttp import web


class ApiError(Exception):
    """A refusal that becomes one OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_OPENAI_TYPES = frozenset(_TYPE_BY_STATUS.values()) | {"server_error", "upstream_error", "service_unavailable"}


def type_for_status(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if status < 500 else "server_error"


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if value is None:
        return None
    return orjson.dumps(value).decode()


def openai_error_body(status: int, body: bytes) -> bytes:
    """A worker's error answer in OpenAI's shape, its message kept (see the module docstring)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = body.decode(errors="replace").strip()
    inner: object = data
    if isinstance(data, dict) and "error" in data:
        inner = data["error"]
    message: str | None = None
    given_type = param = code = None
    if isinstance(inner, dict):
        message = _text(inner.get("message", inner.get("detail")))
        given_type, param, code = inner.get("type"), inner.get("param"), inner.get("code")
    else:
        message = _text(inner)
    if not message:
        message = f"the worker answered HTTP {status}"
    kind = given_type if isinstance(given_type, str) and given_type in _OPENAI_TYPES else type_for_status(status)
    return error_body(
        message,
        type=kind,
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) else None,
    )


_ERROR_EVENT = b'data: {"error"'


def reshape_error_events(data: bytes) -> bytes:
    """Server-sent events with a worker's error (``data: {"error": ...}``, complete within ``data``)
    rewritten in OpenAI's shape; other bytes unchanged. Cheap when there is none (one search)."""
    if _ERROR_EVENT not in data:
        return data
    events = data.split(b"\n\n")
    for i, event in enumerate(events[:-1]):  # the last piece may be an event in the making
        if event.startswith(_ERROR_EVENT):
            try:
                inner = orjson.loads(event[6:]).get("error")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            code = inner.get("code") if isinstance(inner, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            events[i] = b"data: " + openai_error_body(status, event[6:])
    return b"\n\n".join(events)


def error_response(err: ApiError) -> web.Response:
    response = web.Response(
        status=err.status,
        body=error_body(err.message, type=err.type, param=err.param, code=err.code),
        content_type="application/json",
        headers=err.headers,
    )
    if err.status == 408:  # the rest of the request may still come: the connection cannot be reused
        response.force_close()
    return response


@contextlib.asynccontextmanager
async def body_deadline(timeout_s: float) -> AsyncIterator[None]:
    """Read a request's body within ``timeout_s`` (0: no limit), else 408 naming
    ``proxy.body_timeout_s``: a client that sends its headers and then trickles its body (or stops)
    would otherwise hold the connection for ever."""
    try:
        async with asyncio.timeout(timeout_s or None):
            yield
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (proxy.body_timeout_s)",
            code="request_timeout",
        ) from None


def error_event(message: str, *, type: str = "upstream_error", code: str | None = None) -> bytes:
    """A server-sent event that ends a stream with an error (the OpenAI SDK raises on it)."""
    return b"data: " + error_body(message, type=type, code=code) + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def model_not_found(model: str, served: Iterable[str]) -> ApiError:
    """404 ``model_not_found``: ``model`` is not one the proxy serves (``served`` named)."""
    names = ", ".join(sorted(served)) or "none yet"
    return ApiError(404, f"the model '{model}' does not exist; served: {names}", param="model", code="model_not_found")
