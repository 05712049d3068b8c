"""Cross-origin requests from browsers (CORS), answered as SGLang and vLLM answer them by default: a
web app that called an engine from the browser keeps working when its base URL points here.

``proxy.cors_allow_origins`` names the origins (``["*"]``, the default: any; ``[]``: no CORS
headers, so browsers refuse cross-origin calls). Authentication is unchanged: a page still needs a
key to call, and credentials (cookies) are never allowed.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

from aiohttp import web

from proxy.errors import ApiError, error_response

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

    def add_preflight_routes(self, router: web.UrlDispatcher) -> None:
        """``OPTIONS`` on every route registered so far (call it last): a route of each resource,
        not a middleware on every request's way, nor a catch-all (which would turn an unknown
        path's 404 into a 405)."""
        for resource in router.resources():
            if isinstance(resource, web.Resource) and all(route.method != "OPTIONS" for route in resource):
                resource.add_route("OPTIONS", self.preflight)

    async def preflight(self, request: web.Request) -> web.StreamResponse:
        """A browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``); any other
        ``OPTIONS`` gets 405 naming the route's methods."""
        if "Access-Control-Request-Method" not in request.headers:
            resource = request.match_info.route.resource
            methods = sorted({r.method for r in resource or ()} - {"OPTIONS"})
            raise web.HTTPMethodNotAllowed(request.method, methods)
        allow = self.allowed(request.headers.get("Origin"))
        if allow is None:
            return error_response(
                ApiError(403, "cross-origin requests from this origin are not allowed (proxy.cors_allow_origins)")
            )
        headers = {
            "Access-Control-Allow-Origin": allow,
            "Access-Control-Allow-Methods": _METHODS,
            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S,
        }
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)  # Vary: on_prepare adds it

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """The CORS headers on an answer to an allowed origin (streams too: before their headers go);
        with a list of origins every answer varies by ``Origin``, for caches between."""
        if self.origins and "*" not in self.origins:
            _vary_by_origin(response.headers)
        allow = self.allowed(request.headers.get("Origin"))
        if allow is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED


def _vary_by_origin(headers: MutableMapping[str, str]) -> None:
    """``Origin`` added to ``Vary`` (kept with what it named already)."""
    vary = headers.get("Vary")
    if vary is None:
        headers["Vary"] = "Origin"
    elif "origin" not in {v.strip().lower() for v in vary.split(",")}:
        headers["Vary"] = f"{vary}, Origin"
