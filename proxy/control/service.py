"""The controller inside ``pacer serve``: one ``cleanup_ctx`` and ``GET /admin/decisions``.

    install_controller(app)     # after build_app has added the front door's own lifecycle

On start-up it builds the journal, the engine's knob table and log reader, a :class:`Rollout`
over the pool and the dispatcher, and a :class:`Controller` fed by the load board's samples, the
supervisor's log lines and the pool's state changes; it then runs the control loop. On shutdown
the loop stops before the front door's own teardown stops the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp
import orjson
from aiohttp import web

from proxy.control.controller import Controller, LogReader
from proxy.control.journal import Journal
from proxy.control.rollout import Rollout
from proxy.engines.base import LogEvent
from proxy.engines.registry import engine_spec
from proxy.server.auth import check_admin_key
from proxy.server.errors import ApiError, error_response
from proxy.server.state import PROXY
from proxy.workers.base import WorkerInfo, WorkerState

__all__ = ["CONTROL", "ControlHandle", "install_controller"]

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class ControlHandle:
    """Filled in when the app starts (the app itself is frozen by then)."""

    controller: Controller | None = None
    journal: Journal | None = None


CONTROL = web.AppKey("control", ControlHandle)


class _LineReader:
    """A log reader for an engine with only a stateless ``parse_line``."""

    def __init__(self, parse_line: Callable[[str, float], LogEvent | None]) -> None:
        self._parse = parse_line

    def feed(self, line: str, now: float) -> list[LogEvent]:
        event = self._parse(line, now)
        return [event] if event is not None else []

    def flush(self, now: float) -> list[LogEvent]:
        return []


def _reader_factory(engine: str) -> Callable[[], LogReader]:
    spec = engine_spec(engine)
    try:
        follower = spec.function("logs", "LogFollower")
        return lambda: follower()
    except AttributeError:
        parse = spec.function("logs", "parse_line")
        return lambda: _LineReader(parse)


def install_controller(app: web.Application) -> None:
    app[CONTROL] = ControlHandle()
    app.router.add_get("/admin/decisions", decisions)
    app.cleanup_ctx.append(_lifecycle)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    st = app[PROXY]
    handle = app[CONTROL]
    policy = st.policy
    settings = policy.control
    engine = policy.engine.engine
    spec = engine_spec(engine)
    journal = Journal(settings.journal_path)
    try:
        classify = spec.function("logs", "classify_death")
    except AttributeError:
        classify = None
    tail = getattr(st.pool, "tail", None)
    actor = Rollout(st.pool, st.dispatcher, drain_timeout_s=settings.drain_timeout_s) if policy.engine.managed else None
    controller = Controller(
        settings,
        spec.function("knobs", "knobs")(),
        journal,
        actor=actor,
        reader_factory=_reader_factory(engine),
        classify_death=classify,
        tail=tail,
        backlog=lambda: len(st.admission),
        hold=st.dispatcher.drain,
    )
    handle.controller, handle.journal = controller, journal
    closed = False

    try:
        resolved_from = spec.function("knobs", "resolved_from_server_info")
    except AttributeError:
        resolved_from = None

    async def read_resolved(info: WorkerInfo) -> None:
        """What the engine chose for args left unset (``mem_fraction_static``...), from its /server_info."""
        if st.session is None or resolved_from is None:
            return
        try:
            async with st.session.get(info.url + "/server_info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return
                payload = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            _log.debug("no /server_info from %s: %s", info.id, exc)
            return
        if isinstance(payload, dict) and not closed:
            controller.set_resolved(info.id, resolved_from(payload))

    def on_state(info: WorkerInfo) -> None:
        if closed:
            return
        controller.track(info)
        if info.state is WorkerState.READY and info.managed:
            st.spawn(read_resolved(info))

    def on_line(worker_id: str, line: str) -> None:
        if not closed:
            controller.on_line(worker_id, line)

    for info in st.pool.workers():
        controller.track(info)
    st.pool.add_listener(on_state)
    add_lines = getattr(st.pool, "add_line_listener", None)
    if add_lines is not None:
        add_lines(on_line)
    st.board.subscribe(controller.on_sample)
    _log.info("controller %s: rules every %g s over %g s windows", settings.mode, settings.interval_s, settings.window_s)
    task = asyncio.create_task(controller.run(), name="pacer-controller")
    try:
        yield
    finally:
        closed = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        st.board.unsubscribe(controller.on_sample)


async def decisions(request: web.Request) -> web.Response:
    """``GET /admin/decisions[?worker=w0][&limit=N]``: the journal, newest last."""
    st = request.app[PROXY]
    try:
        check_admin_key(st.keys, request.headers)
        limit_text = request.query.get("limit")
        limit = None
        if limit_text is not None:
            if not limit_text.isdigit() or int(limit_text) < 1:
                raise ApiError(400, f"limit must be a positive integer, got {limit_text!r}", param="limit")
            limit = int(limit_text)
    except ApiError as err:
        return error_response(err)
    handle = request.app[CONTROL]
    journal = handle.journal
    entries = journal.entries(worker=request.query.get("worker"), limit=limit) if journal is not None else []
    controller = handle.controller
    body = {"mode": str(controller.mode) if controller else str(st.policy.control.mode), "decisions": entries}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
