"""HTTP handlers: OpenAI-compatible routes, SGLang's ``/generate``, health, metrics and admin.

Every refusal is an :class:`~proxy.errors.ApiError` turned into an OpenAI-shaped body here;
a bug in the proxy becomes a 500 with a short message, never a traceback to the client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from proxy.control.controller import TrialRefused
from proxy.engines.base import KnobName
from proxy.errors import ApiError, bad_request, body_deadline, error_response, model_not_found
from proxy.policy import PoolSettings
from proxy.request import relay
from proxy.request.admission import ORDER, Priority
from proxy.request.job import Job
from proxy.server.auth import check_admin_key, check_api_key
from proxy.server.metrics import CONTENT_TYPE
from proxy.server.state import PROXY, ProxyState
from proxy.server.validation import VALIDATORS
from proxy.workers.base import WorkerState

_log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID = web.RequestKey("request_id", str)  # an inference request's id, its x-request-id header


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``x-request-id`` on every answer to an inference request, its error answers too: the id a
    client quotes, and the name of its attempts on a worker that names requests (``ID.1``, ...)."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, within ``limit`` bytes and ``timeout_s`` seconds (0: no limit): a client that
    sends complete headers and then trickles its body would otherwise hold the connection for ever."""
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(
            413, f"request body is {length} bytes; the limit is {limit} (proxy.max_body_bytes)", code="body_too_large"
        )
    try:
        async with body_deadline(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"request body is larger than the limit of {limit} bytes (proxy.max_body_bytes)", code="body_too_large"
        ) from None


def pick_priority(st: ProxyState, headers: Mapping[str, str], key_class: Priority | None) -> Priority:
    """The header picks a class; a key bound to ``batch`` cannot raise itself to ``interactive``."""
    name = st.policy.queue.priority_header
    value = headers.get(name)
    if value is None:
        chosen = key_class or Priority(st.policy.queue.default_priority)
    else:
        try:
            chosen = Priority(value.strip().lower())
        except ValueError:
            raise bad_request(
                f"header {name} must be one of: {', '.join(p.value for p in ORDER)}; got {value!r}"
            ) from None
    if key_class is not None and ORDER.index(key_class) > ORDER.index(chosen):
        return key_class
    return chosen


def check_model(st: ProxyState, job: Job) -> None:
    """A request naming a model must name a served one (404). Without ``model``: with one pool it
    goes to that pool (an OpenAI request gets the served name); with several pools it is a 400
    naming the models, since no pool is more the default than another."""
    models = st.models
    if job.model is None:
        st.requests.pool_for(None)  # several pools: a 400 naming their models
        if job.path != "/generate" and models.default is not None:
            job.body["model"] = models.default
        return
    if models.known and job.model not in models.names:
        raise model_not_found(job.model, models.names)


def inference_route(path: str) -> Handler:
    validate = VALIDATORS[path]

    async def handle(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        st = request.app[PROXY]
        request[REQUEST_ID] = request_id = st.requests.new_rid()
        try:
            try:
                caller = check_api_key(st.keys, request.headers)
            except ApiError:
                st.metrics.reject_auth.inc()
                raise
            try:
                job = validate(await read_body(request, st.policy.proxy.max_body_bytes, st.policy.proxy.body_timeout_s))
                if not st.models.known and job.path != "/generate" and st.session is not None:
                    await st.models.ensure(
                        st.session, [w.url for w in st.pool.workers() if w.state is WorkerState.READY]
                    )
                job.request_id = request_id
                check_model(st, job)
                priority = pick_priority(st, request.headers, caller.cls)
            except ApiError:
                st.metrics.reject_invalid.inc()
                raise
            return await relay.forward(st.requests, request, job, priority, arrived, caller.name)
        except ApiError as err:
            return error_response(err)

    handle.__name__ = f"handle_{path.strip('/').replace('/', '_')}"
    return handle


async def _model_cards(request: web.Request) -> list[dict[str, object]]:
    """The served models' cards, for a caller with a key (401 otherwise)."""
    st = request.app[PROXY]
    check_api_key(st.keys, request.headers)
    if not st.models.known and st.session is not None:
        await st.models.ensure(st.session, [w.url for w in st.pool.workers() if w.state is WorkerState.READY], 0.0)
    return list(st.models.cards)


async def list_models(request: web.Request) -> web.Response:
    try:
        return _json({"object": "list", "data": await _model_cards(request)})
    except ApiError as err:
        return error_response(err)


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one served model's card (a model id may hold slashes), 404 naming
    the served ones otherwise."""
    wanted = request.match_info["model"]
    try:
        cards = await _model_cards(request)
        for card in cards:
            if card.get("id") == wanted:
                return _json(card)
        raise model_not_found(wanted, (str(c.get("id")) for c in cards))
    except ApiError as err:
        return error_response(err)


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    st = request.app[PROXY]
    workers = st.pool.workers()
    n = sum(1 for w in workers if w.state is WorkerState.READY)
    if n:
        serving = {w.pool for w in workers if w.state is WorkerState.READY}
        # a pool with none ready: its model's requests wait (or are refused), though the proxy is ready
        down = sorted({w.pool for w in workers} - serving)
        return _json({"status": "ready", "ready_workers": n, "workers": len(workers), "pools_not_serving": down})
    return error_response(
        ApiError(
            503,
            f"no worker is ready ({', '.join(f'{w.id} {w.state}' for w in workers) or 'none'})",
            type="service_unavailable",
            code="not_ready",
        )
    )


async def metrics(request: web.Request) -> web.Response:
    st = request.app[PROXY]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def admin_workers(request: web.Request) -> web.Response:
    st = request.app[PROXY]
    check_admin_key(st.keys, request.headers)  # a refusal is answered by error_middleware
    now = time.monotonic()
    out = []
    for w in st.pool.workers():
        load = st.board.get(w.id)
        snap = load.snapshot()
        sample = snap["sample"]
        if isinstance(sample, dict):
            sample["age_s"] = round(now - float(sample["time"]), 3)
        out.append(
            {
                "id": w.id,
                "pool": w.pool,
                "model": w.model,
                "gpus": list(w.gpus),
                "node": w.node,
                "url": w.url,
                "state": w.state.value,
                "managed": w.managed,
                "args": dict(w.args),
                "pid": w.pid,
                "restarts": w.restarts,
                "last_error": w.last_error,
                "stays_down": w.stays_down,
                "crash_loop": w.crash_loop,
                "fresh": load.fresh(now, st.policy.pacing.stale_after_s),
                "draining": w.state is WorkerState.DRAINING,
                **snap,
            }
        )
    queue = {p.value: st.admission.depth(p) for p in ORDER}
    pools = {
        name: {p.value: d.admission.depth(p) for p in ORDER} for name, d in st.requests.pools.items()
    }  # each pool's own queue
    body = {"workers": out, "proxy_queue": queue, "pool_queues": pools, "in_flight": st.board.total_in_flight()}
    role = getattr(st.pool, "role", None)  # several replicas: this one's part (proxy.workers.replicas)
    if callable(role):
        body["replica"] = role()
    return _json(body)


async def admin_gpus(request: web.Request) -> web.Response:
    """The newest NVML report, its age and the sampling interval; the no-GPU state is a 200 too."""
    st = request.app[PROXY]
    check_admin_key(st.keys, request.headers)
    if st.gpus is None:
        return _json(
            {
                "available": False,
                "reason": "GPU sampling is off (proxy.gpu_sample_interval_s = 0)",
                "devices": [],
                "interval_s": 0.0,
            }
        )
    report = st.gpus.last
    if report is None:
        return _json({"available": False, "reason": "not sampled yet", "devices": [], "interval_s": st.gpus.interval_s})
    return _json(
        {**report.to_json(), "age_s": round(time.monotonic() - report.time, 3), "interval_s": st.gpus.interval_s}
    )


async def admin_decisions(request: web.Request) -> web.Response:
    """``GET /admin/decisions[?worker=w0][&limit=N]``: the controller's journal, newest last."""
    st = request.app[PROXY]
    check_admin_key(st.keys, request.headers)
    limit_text = request.query.get("limit")
    limit = None
    if limit_text is not None:
        if not limit_text.isdigit() or int(limit_text) < 1:
            raise ApiError(400, f"limit must be a positive integer, got {limit_text!r}", param="limit")
        limit = int(limit_text)
    journal = st.journal
    entries = journal.entries(worker=request.query.get("worker"), limit=limit) if journal is not None else []
    return _json({"mode": st.control_mode(), "decisions": entries})


def _trial_pool(st: ProxyState, worker_id: object) -> PoolSettings:
    """The pool of the worker a trial names: its engine says which arguments the trial may set (the
    first pool where no worker has that id)."""
    info = next((w for w in st.pool.workers() if w.id == worker_id), None)
    return next((p for p in st.policy.pools if info is not None and p.name == info.pool), st.policy.pools[0])


async def admin_trial(request: web.Request) -> web.Response:
    """``POST /admin/trial`` ``{"worker": "w1", "args": {"max_running_requests": 4}, "note": "..."}``: an
    operator's trial of ``args`` on one worker as a canary (merged over its own args), journalled with
    reason "operator trial" and judged, promoted, kept or reverted by the controller's canary code.
    202 with the journal entry's id; 400 for bad input, 404 for an unknown worker, 409 when it cannot
    start now (not ``auto``, one worker, a canary or restart under way)."""
    st = request.app[PROXY]
    check_admin_key(st.keys, request.headers)
    try:
        body = orjson.loads(await read_body(request, st.policy.proxy.max_body_bytes, st.policy.proxy.body_timeout_s))
    except orjson.JSONDecodeError:
        raise bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - {"worker", "args", "note"})
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; expected worker, args, note", param=unknown[0])
    worker_id, args, note = body.get("worker"), body.get("args"), body.get("note", "")
    if not isinstance(worker_id, str) or not worker_id:
        raise bad_request("worker: expected a worker id (see /admin/workers)", param="worker")
    if not isinstance(args, dict) or not args:
        example = _trial_pool(st, worker_id).engine.engine.knobs[KnobName.MAX_RUNNING].arg
        raise bad_request(f'args: expected an object of engine arguments, e.g. {{"{example}": 4}}', "args")
    if not isinstance(note, str):
        raise bad_request("note: expected a string", param="note")
    info = next((w for w in st.pool.workers() if w.id == worker_id), None)
    controller = st.controllers.get(info.pool) if info is not None else None
    if info is None or controller is None:
        known = ", ".join(w.id for w in st.pool.workers())
        raise ApiError(404, f"no worker {worker_id!r}; the workers are {known}", param="worker", code="not_found")
    pool = _trial_pool(st, worker_id)
    engine = pool.engine.engine
    placed = engine.placement_args(1, pool.model)
    for name, value in args.items():
        if name in placed:
            raise bad_request(f"args.{name}: set by the pool (its tp and model keys), not by a trial", f"args.{name}")
        if name in engine.model_args:
            raise bad_request(
                f"args.{name}: says which model the worker serves; a trial compares the pool's workers on one model",
                f"args.{name}",
            )
        problem = engine.check_arg(name, value)
        if problem:
            raise bad_request(f"args.{name}: {problem}", param=f"args.{name}")
    try:
        entry_id = controller.start_trial(worker_id, args, note=note)
    except TrialRefused as exc:
        raise ApiError(409, str(exc), param="worker", code=exc.code) from None
    return _json(
        {
            "entry": entry_id,
            "worker": worker_id,
            "args": args,
            "judged_after_s": controller.constants.window_s,
            "status": "acting",
        },
        status=202,
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (404, 405) and any bug become OpenAI-shaped JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        what = "no route" if exc.status == 404 else exc.reason
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405 says what the route takes
        return error_response(
            ApiError(
                exc.status,
                f"{what}: {request.method} {request.path}",
                code="not_found" if exc.status == 404 else None,
                headers=allow,
            )
        )
    except ApiError as err:
        return error_response(err)
    except ConnectionResetError:
        raise
    except Exception:
        _log.exception("internal error on %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal error in the proxy (see its log)", type="server_error"))
