"""The engines' own endpoints besides inference (:class:`~proxy.engines.base.NativeRoute`): SGLang's
model and server info (its frontend's ``RuntimeEndpoint`` reads ``/get_model_info`` as it starts),
its deep health check, a cache flush and an abort by ``rid``; vLLM's ``/version``.

Each is served as the engine serves it, with the caller's API key checked as for inference (the
admin key for what acts on every caller's work: a flush, an abort, which SGLang lets end all):

- from one ready worker of the model (the one with the fewest of the proxy's requests open), its
  answer as it gave it;
- or from every worker of the model that runs requests (``every_worker``: ready or draining), one
  answer: the first worker's when every one succeeded, else an error naming each worker that did
  not (the first refusal's status, as SGLang's 400 for a flush while requests run; 502 for a failure).

The model is ``?model=NAME`` (a body has no model on these routes); without one, a proxy serving
several models sends an ``every_worker`` call to all of them and refuses the others with a 400
naming the models. A request still in the proxy's queue is not a worker's yet: an abort by ``rid``
reaches only what runs on the workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy.engines.base import NativeRoute
from proxy.engines.contract import Engine
from proxy.errors import ApiError, error_body, error_response, model_not_found
from proxy.server.auth import check_admin_key, check_api_key
from proxy.server.handlers import Handler, read_body
from proxy.server.state import PROXY, ProxyState
from proxy.workers.base import WorkerInfo, WorkerState

__all__ = ["add_native_routes"]

# SGLang's /health_generate waits up to 20 s for a token (HEALTH_CHECK_TIMEOUT); a flush up to its ?timeout
_TIMEOUT = aiohttp.ClientTimeout(total=60)
_ERROR_CHARS = 300  # of a worker's refusal, quoted in the answer


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    content_type: str
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def add_native_routes(app: web.Application, engines: Iterable[Engine]) -> None:
    """A route for each native endpoint of the pools' engines (one per method and path)."""
    routes: dict[tuple[str, str], NativeRoute] = {}
    for engine in engines:
        for route in engine.native_routes:
            routes.setdefault((route.method, route.path), route)
    for route in routes.values():
        app.router.add_route(route.method, route.path, _handler(route))


def _handler(route: NativeRoute) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        st = request.app[PROXY]
        try:
            if route.operator:
                check_admin_key(st.keys, request.headers)
            else:
                check_api_key(st.keys, request.headers)
            body = b""
            if request.method == "POST":
                body = await read_body(request, st.policy.proxy.max_body_bytes, st.policy.proxy.body_timeout_s)
            workers = _workers_for(st, route, request.query.get("model"))
            if not route.every_worker:
                chosen = min(workers, key=lambda w: st.board.get(w.id).in_flight)
                return _respond(await _send(st, chosen, request, body))
            answers = await asyncio.gather(*(_send(st, w, request, body) for w in workers))
            failed = [(w, a) for w, a in zip(workers, answers, strict=True) if not a.ok]
            if failed:  # a refusal as the engine gave it (SGLang: 400 "Cache not flushed" while busy), else 502
                said = "; ".join(f"{w.id}: {a.status} {_quote(a)}" for w, a in failed)
                first = failed[0][1].status
                refused = 400 <= first < 500
                raise ApiError(
                    first if refused else 502,
                    f"{route.method} {route.path} failed on {len(failed)} of {len(workers)} workers ({said})",
                    type="invalid_request_error" if refused else "upstream_error",
                    code=None if refused else "upstream_failed",
                )
            return _respond(answers[0])
        except ApiError as err:
            return error_response(err)

    handle.__name__ = f"native_{route.method.lower()}_{route.path.strip('/')}"
    return handle


def _workers_for(st: ProxyState, route: NativeRoute, model: str | None) -> list[WorkerInfo]:
    """The workers the call goes to (ready ones; draining ones too for a call to every worker: their
    requests run on): of ``model``'s pool, else of every pool whose engine has the route (one pool
    only for a call one worker answers); 404, 400 or 503 saying why there are none."""
    engines = st.requests.engines
    pools = [name for name, engine in engines.items() if route in engine.native_routes]
    if model is not None:
        if st.models.known and model not in st.models.names:  # several pools: each model is declared
            raise model_not_found(model, st.models.names)
        if model in st.requests.models:
            pools = [p for p in pools if p == st.requests.models[model]]
    elif len(pools) > 1 and not route.every_worker:
        raise ApiError(
            400,
            f"this proxy serves several models: add ?model=NAME to {route.path} "
            f"(one of {', '.join(sorted(st.requests.models))})",
            param="model",
            code="model_required",
        )
    if not pools:
        raise ApiError(404, f"the model's engine has no {route.method} {route.path}", code="not_found")
    workers = [w for w in st.pool.workers() if w.pool in pools]
    running = (WorkerState.READY, WorkerState.DRAINING) if route.every_worker else (WorkerState.READY,)
    ready = [w for w in workers if w.state in running]
    if not ready:
        states = ", ".join(f"{w.id} {w.state}" for w in workers) or "none configured"
        raise ApiError(503, f"no worker is ready ({states})", type="service_unavailable", code="not_ready")
    return ready


async def _send(st: ProxyState, worker: WorkerInfo, request: web.Request, body: bytes) -> _Answer:
    """The call as the client made it (its query, less ``model``; its body), to ``worker``."""
    session = st.session
    if session is None:
        raise ApiError(503, "sglang-pacer is not serving yet", type="service_unavailable", code="not_ready")
    query = [(k, v) for k, v in request.query.items() if k != "model"]
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")} if body else {}
    try:
        async with session.request(
            request.method,
            worker.url + request.path,
            params=query,
            data=body or None,
            headers=headers,
            timeout=_TIMEOUT,
        ) as resp:
            return _Answer(resp.status, resp.content_type, await resp.read())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        message = f"worker {worker.id} did not answer {request.method} {request.path} ({detail})"
        return _Answer(502, "application/json", error_body(message, type="upstream_error", code="upstream_failed"))


def _quote(answer: _Answer) -> str:
    text = answer.body.decode("utf-8", "replace").strip()
    return repr(text[:_ERROR_CHARS] + ("..." if len(text) > _ERROR_CHARS else ""))


def _respond(answer: _Answer) -> web.Response:
    return web.Response(status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type})
