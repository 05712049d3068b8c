"""Cross-origin requests from browsers (CORS), answered as SGLang and vLLM answer them by default: a
web app that called an engine from the browser keeps working when its base URL points here.

``proxy.cors_allow_origins`` names the origins (``["*"]``, the default: any; ``[]``: no CORS
headers, so browsers refuse cross-origin calls). Authentication is unchanged: a page still needs a
key to call, and credentials (cookies) are never allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

__all__ = ["Cors"]

_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
_EXPOSED = ", ".join(
    (
        "x-request-id",
        "retry-after",
        *(f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")),
    )
)
_PREFLIGHT_MAX_AGE_S = "600"


@dataclass(frozen=True, slots=True)
class Cors:
    origins: tuple[str, ...]

    def allowed(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin`` (None: not allowed)."""
        if origin is None or not self.origins:
            return None
        if "*" in self.origins:
            return "*"
        return origin if origin in self.origins else None

    def add_preflight_route(self, router: web.UrlDispatcher) -> None:
        """``OPTIONS`` on every path: the proxy's routes know no other use of it (a route, not a
        middleware: nothing is added to the other requests' way)."""
        router.add_route("OPTIONS", "/{path:.*}", self.preflight)

    async def preflight(self, request: web.Request) -> web.StreamResponse:
        """A browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``); any other
        ``OPTIONS`` gets 405, as before."""
        if "Access-Control-Request-Method" not in request.headers:
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST", "PUT", "DELETE"])
        allow = self.allowed(request.headers.get("Origin"))
        if allow is None:
            return web.Response(status=403, text="cross-origin requests from this origin are not allowed")
        headers = {
            "Access-Control-Allow-Origin": allow,
            "Access-Control-Allow-Methods": _METHODS,
            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S,
        }
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        if allow != "*":
            headers["Vary"] = "Origin"
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """The CORS headers on an answer to an allowed origin (streams too: before their headers go)."""
        allow = self.allowed(request.headers.get("Origin"))
        if allow is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
        if allow != "*":
            response.headers["Vary"] = "Origin"
