"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every refusal the proxy makes goes through :func:`error_response` (or :func:`error_event` inside a
stream that already started), so a client always gets a JSON body that names the problem::

    ApiError                       status  type
    ├── bad input (validation)     400     invalid_request_error
    ├── body too large             413     invalid_request_error
    ├── missing / wrong API key    401     authentication_error
    ├── unknown model              404     invalid_request_error, code model_not_found
    ├── proxy queue full           429     rate_limit_error (+ Retry-After)
    ├── queue timeout / no worker  503     service_unavailable
    ├── upstream failed            502     upstream_error
    └── upstream too slow          504     upstream_timeout
"""

from __future__ import annotations

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


def error_response(err: ApiError) -> web.Response:
    return web.Response(
        status=err.status,
        body=error_body(err.message, type=err.type, param=err.param, code=err.code),
        content_type="application/json",
        headers=err.headers,
    )


def error_event(message: str, *, type: str = "upstream_error", code: str | None = None) -> bytes:
    """A server-sent event that ends a stream with an error (the OpenAI SDK raises on it)."""
    return b"data: " + error_body(message, type=type, code=code) + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)
