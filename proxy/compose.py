"""The composition root: ``build_app(policy, pool)`` wires the front door, the request path, the
observers and the controller around one worker pool.

Lifecycle (one ``cleanup_ctx`` generator): open the shared upstream session, subscribe to worker
state changes, start the pool (in the background, so ``/health`` answers while workers load),
start the scraper, the status log and the GPU watch (the dashboard's history is one more observer
of the board's samples); on shutdown stop them, stop the pool and close the session.
The controller and the Batch API (``/v1/files``, ``/v1/batches``: its store and runner) have a
``cleanup_ctx`` generator each, started after that one and stopped before it.
Serve it with :func:`serving` (or :func:`serve`, :func:`make_runner`; ``handler_cancellation=True``: a
client that disconnects cancels its handler, which frees its slot and aborts the upstream request):
the address is bound before the app starts, so a port in use fails before any worker launches.
Stopping begins with the drain (an ``on_shutdown`` hook, :mod:`proxy.server.drain`): queued
requests get 503 at once, the requests in flight get ``proxy.shutdown_grace_s`` to end and are then
ended (:func:`stop_now`, a second signal, ends them at once); then the lifecycles above stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from proxy.batch import BATCH_SERVICE, Authenticate, BatchService, add_routes, owner_of
from proxy.batch.executor import RequestPathExecutor
from proxy.compose_fast_tier import BudgetJournal
from proxy.compose_fast_tier import fast_tier as _fast_tier
from proxy.compose_fast_tier import look_again as _look_again
from proxy.control.constants import CONSTANTS, Constants
from proxy.control.controller import Controller
from proxy.control.evidence import OutputBudget
from proxy.control.fast_tier import PaceSettings
from proxy.control.journal import Journal
from proxy.control.offload import PlanProcess
from proxy.control.planner import InFlight, Observed
from proxy.control.rollout import Drainable, RestartablePool, Rollout
from proxy.control.shared_journal import close_journal, open_journal
from proxy.dashboard import HISTORY, History
from proxy.dashboard import add_routes as add_dashboard_routes
from proxy.engines.base import KnobName, Modelled, Sample
from proxy.engines.contract import Engine
from proxy.observe.nvml import GpuWatch, Sampler, sample_gpus
from proxy.observe.scraper import MIN_WALL_INTERVAL_S, Scraper
from proxy.policy import ControlMode, Policy, PoolSettings, WorkerBackend
from proxy.request.admission import ORDER, AdmissionQueue, Priority
from proxy.request.dispatch import Dispatcher
from proxy.request.limits import KeyLimits
from proxy.request.pacing import Band, LoadBoard
from proxy.request.path import RequestPath, RequestSettings
from proxy.request.queues import QueueTotals
from proxy.request.shared_limits import key_limiter
from proxy.server import handlers
from proxy.server.auth import ANONYMOUS, bearer, check_api_key, describe, load_keyring
from proxy.server.cors import Cors
from proxy.server.drain import Drain
from proxy.server.metrics import ProxyMetrics
from proxy.server.models import ModelCatalog
from proxy.server.native import add_native_routes
from proxy.server.protocol import EdgeRunner, Listener, ListenerSite
from proxy.server.state import PROXY, ProxyState
from proxy.server.status_log import run_status_log
from proxy.server.validation import CHAT, COMPLETIONS, GENERATE, VALIDATORS
from proxy.workers.base import PlannedLaunches, WorkerInfo, WorkerLogs, WorkerPool, WorkerState
from proxy.workers.fleet import PoolView
from proxy.workers.replicas import ReplicaPool

CONTROL_CONSTANTS = web.AppKey("control_constants", Constants)  # build_app's, for the controllers' lifecycle
_log = logging.getLogger(__name__)
_LAUNCH_NVML_TIMEOUT_S = 5.0  # a first launch waits this long at most for NVML's size of its GPU


def build_app(
    policy: Policy,
    pool: WorkerPool,
    *,
    manage_pool: bool = True,
    gpu_sampler: Sampler = sample_gpus,
    control_constants: Constants = CONSTANTS,
) -> web.Application:
    """The proxy app. With ``manage_pool`` it starts and stops ``pool`` with the app; ``gpu_sampler``
    reads the GPUs every ``proxy.gpu_sample_interval_s`` (NVML by default); ``control_constants`` are
    the controllers' and the fast tier's (in the engine's seconds; tests shorten them).

    Raises :class:`proxy.server.auth.AuthConfigError` if a key file cannot be read.
    """
    keys = load_keyring(policy.auth)
    board = LoadBoard()  # one per proxy: worker ids are unique across pools
    interval = policy.proxy.gpu_sample_interval_s
    gpus = GpuWatch(interval, gpu_sampler) if interval > 0 else None
    several = len(policy.pools) > 1
    queues = _admission_queues(policy)
    admission = queues[0] if not several else QueueTotals(queues)
    metrics = ProxyMetrics(
        admission,
        {p.name: queue for p, queue in zip(policy.pools, queues, strict=True)},
        board,
        pool.workers,
        lambda: gpus.last if gpus is not None else None,
    )
    dispatchers = _dispatchers(policy, pool, board, queues, metrics)
    declared = [(p.model, p.name) for p in policy.pools if p.model is not None]
    st = ProxyState(
        policy=policy,
        pool=pool,
        board=board,
        admission=admission,
        requests=_request_path(policy, pool, board, dispatchers, metrics),
        metrics=metrics,
        keys=keys,
        models=ModelCatalog.declared(declared) if declared else ModelCatalog(),
        gpus=gpus,
        drain=Drain(policy.proxy.shutdown_grace_s),
    )
    _hook_fast_tiers(st, dispatchers, control_constants)
    return _application(st, manage_pool, control_constants)


def _admission_queues(policy: Policy) -> list[AdmissionQueue]:
    """Each pool's own queue, fair between keys as [admission] says; where the pool's engine sorts its
    queue by prefix, the proxy's sorts its own the same way, within the engine's limit."""
    fair = policy.admission
    return [
        AdmissionQueue(
            policy.queue.capacity,
            weights={name: k.weight for name, k in fair.keys.items()},
            batch_floor=fair.batch_floor_share,
            quantum=fair.quantum_tokens,
            prefix_first=p.engine.engine.prefix_queue_limit(p.engine.args) or 0,
        )
        for p in policy.pools
    ]


def _dispatchers(
    policy: Policy, pool: WorkerPool, board: LoadBoard, queues: Sequence[AdmissionQueue], metrics: ProxyMetrics
) -> dict[str, Dispatcher]:
    """Each pool's gate over its own workers and its own queue, with its own [pacing] (and [pool.pacing])."""
    several = len(policy.pools) > 1
    return {
        p.name: Dispatcher(
            PoolView(pool, p.name) if several else pool,
            board,
            queue,
            band=Band(lo=p.pacing.queue_band[0], hi=p.pacing.queue_band[1], headroom=p.pacing.headroom),
            stale_after_s=p.pacing.stale_after_s,
            prefix_affinity=p.engine.engine.prefix_affinity(p.engine.args),
            prefix_limit=p.engine.engine.prefix_queue_limit,
            max_attempts=p.pacing.max_attempts,
            on_requeue=metrics.of(p.name).count_requeue,
            clock_rate=_clock_rate(p),  # the window beside interactive work is in the engine's seconds
        )
        for p, queue in zip(policy.pools, queues, strict=True)
    }


def _request_path(
    policy: Policy,
    pool: WorkerPool,
    board: LoadBoard,
    dispatchers: Mapping[str, Dispatcher],
    metrics: ProxyMetrics,
) -> RequestPath:
    """The request path over the pools' dispatchers, with the per-key limits (across every pool)."""
    fair = policy.admission
    return RequestPath(
        RequestSettings.from_policy(policy),
        pool,
        board,
        dispatchers,
        {p.name: metrics.of(p.name) for p in policy.pools},
        models={p.model: p.name for p in policy.pools if p.model is not None},
        limits=key_limiter(  # per key, across every pool (and every replica, on a shared store)
            {
                name: KeyLimits(k.requests_per_minute, k.tokens_per_minute, k.max_concurrent)
                for name, k in fair.keys.items()
            },
            policy.store.url,
            concurrent_retry_after_s=policy.queue.retry_after_s,
        ),
        engines={p.name: p.engine.engine for p in policy.pools},
    )


def _hook_fast_tiers(st: ProxyState, dispatchers: Mapping[str, Dispatcher], constants: Constants) -> None:
    """Each pool in auto: its workers' pace, from its own band, queue and dispatcher, on each scrape
    (the board's samples) and on an interactive spell; the budgets that moved go to its controller."""
    for p in st.policy.pools:
        if p.control.mode is ControlMode.AUTO:
            dispatcher = dispatchers[p.name]
            settings = PaceSettings.of(
                p.control,
                clock_rate=_clock_rate(p),
                constants=constants,
                interactive_window_s=dispatcher.interactive_window_s,
            )
            fast_tier = _fast_tier(st.board, dispatcher, settings, _budget_journal(st, p.name), p.engine.engine)
            st.board.subscribe(fast_tier)
            dispatcher.on_interactive_spell = _look_again(st.board, dispatcher, fast_tier)


def _budget_journal(st: ProxyState, pool_name: str) -> BudgetJournal:
    """The fast tier's output budgets, to the pool's controller (read when a budget moves)."""

    def journal(worker_id: str, evidence: OutputBudget, now: float) -> None:
        controller = st.controllers.get(pool_name)  # none before the app starts: nothing served yet
        if controller is not None:
            controller.on_output_budget(worker_id, evidence, now)

    return journal


def _application(st: ProxyState, manage_pool: bool, control_constants: Constants) -> web.Application:
    """The aiohttp app around ``st``: its middleware, routes, shutdown drain and lifecycles."""
    policy = st.policy
    cors = Cors(policy.proxy.cors_allow_origins)
    app = web.Application(client_max_size=policy.proxy.max_body_bytes, middlewares=[handlers.error_middleware])
    app.on_response_prepare.extend((handlers.add_request_id, cors.on_prepare))
    app[PROXY] = st
    app[CONTROL_CONSTANTS] = control_constants
    _add_api_routes(app)
    _add_dashboard(app, st)
    app.on_shutdown.append(_drain)  # runs before aiohttp waits for the open handlers
    app.cleanup_ctx.append(_lifecycle(st, manage_pool))
    app.router.add_get("/admin/decisions", handlers.admin_decisions)
    app.router.add_post("/admin/trial", handlers.admin_trial)
    app.cleanup_ctx.append(_control_lifecycle)  # after the lifecycle above: stops before the workers do
    add_native_routes(app, (p.engine.engine for p in policy.pools))
    add_routes(app, authenticate=_batch_caller(st))
    app.cleanup_ctx.append(_limits_lifecycle)
    app.cleanup_ctx.append(_batch_lifecycle)  # the last to start: stops first, while the request path is open
    cors.add_preflight_routes(app.router)  # every route is in
    return app


def _add_api_routes(app: web.Application) -> None:
    """The inference routes, the model list, health, readiness, metrics and the workers' and GPUs' views."""
    for path in (CHAT, COMPLETIONS, GENERATE):
        app.router.add_post(path, handlers.inference_route(path))
    app.router.add_put(GENERATE, handlers.inference_route(GENERATE))
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.retrieve_model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/admin/workers", handlers.admin_workers)
    app.router.add_get("/admin/gpus", handlers.admin_gpus)


def _add_dashboard(app: web.Application, st: ProxyState) -> None:
    """The dashboard's routes and its history, one more observer of the board's samples."""
    admission, board = st.admission, st.board
    history = History(
        lambda: ({p.value: admission.depth(p) for p in ORDER}, board.total_in_flight()),
        lambda worker_id: board.get(worker_id).in_flight,
    )
    board.subscribe(history.on_sample)  # the scraper's samples, as the dispatcher and controller see them
    app[HISTORY] = history
    add_dashboard_routes(app)


def _lifecycle(st: ProxyState, manage_pool: bool) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        policy = st.policy
        for line in describe(st.keys):
            _log.warning("%s", line) if "OPEN" in line else _log.info("%s", line)
        unknown = sorted(set(policy.admission.keys) - set(st.keys.names()))
        if unknown and not st.keys.open:
            _log.warning("admission.keys names no configured key: %s (see [auth] name=)", ", ".join(unknown))
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        # workers' cookies are not the proxy's to keep (nor to pass from one client's request to another's)
        st.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )
        st.requests.open(st.session)  # its own connections to the workers; the session serves aborts too
        for pool_settings in policy.pools:
            st.scrapers[pool_settings.name] = Scraper(
                PoolView(st.pool, pool_settings.name) if len(policy.pools) > 1 else st.pool,
                st.board,
                st.session,
                engine=pool_settings.engine.engine,
                interval_s=pool_settings.pacing.scrape_interval_s,
                timeout_s=max(pool_settings.pacing.scrape_interval_s, min(pool_settings.pacing.stale_after_s, 5.0)),
                on_result=functools.partial(_on_scrape, st, st.requests.dispatcher_of(pool_settings.name)),
                clock_rate=_clock_rate(pool_settings),  # scrape_interval_s is in the engine's seconds
            )

        def on_state(info: WorkerInfo) -> None:
            st.requests.dispatcher_of(info.pool).on_worker_state(info)
            if info.state is WorkerState.READY:
                for scraper in st.scrapers.values():
                    scraper.kick()
                if not st.models.known and st.session is not None:
                    st.spawn(st.models.refresh(st.session, info.url))

        st.pool.add_listener(on_state)
        tasks = [
            *(asyncio.create_task(s.run(), name="pacer-scraper") for s in st.scrapers.values()),
            asyncio.create_task(
                run_status_log(
                    st.admission, st.board, st.pool, policy.proxy.status_log_interval_s, policy.pacing.stale_after_s
                ),
                name="pacer-status-log",
            ),
        ]
        tasks.append(asyncio.create_task(app[HISTORY].run(policy.pacing.scrape_interval_s), name="pacer-history"))
        if st.gpus is not None:
            tasks.append(asyncio.create_task(st.gpus.run(), name="pacer-gpu-watch"))
        if manage_pool:
            tasks.append(asyncio.create_task(_start_pool(st), name="pacer-pool-start"))
        else:
            for info in st.pool.workers():
                on_state(info)
        try:
            yield
        finally:
            await _stop_tasks(tasks)
            for ticket in st.admission.drain_all():
                if not ticket.future.done():
                    ticket.future.cancel()
            if manage_pool:
                await st.pool.stop()
            await st.requests.close()
            await st.session.close()

    return ctx


class _Surroundings:
    """The pool's log tail, its proxy queue's backlog and its workers' requests, as a pool's controller
    asks for them; its workers' output budgets held back while the controller measures one."""

    def __init__(self, st: ProxyState, dispatcher: Dispatcher, gate_period_s: float = 0.0) -> None:
        self._st = st
        self._dispatcher = dispatcher
        self._gate_period_s = gate_period_s

    def log_tail(self, worker_id: str, lines: int) -> Sequence[str]:
        pool = self._st.pool
        return pool.tail(worker_id, lines) if isinstance(pool, WorkerLogs) else []

    def backlog(self) -> int:
        return len(self._dispatcher.admission)

    def held_for_class(self) -> int:
        return self._dispatcher.held_for_class()

    def recent_requests(self, worker_id: str) -> Sequence[Observed]:
        return [
            Observed(
                arrived=f.arrived,
                prompt_tokens=f.prompt_tokens,
                output_tokens=f.output_tokens,
                # what the worker was asked for: its output budget (an answer in one part), else the client's
                max_tokens=f.sent_max_tokens if f.sent_max_tokens is not None and f.parts == 1 else f.max_tokens,
                finished=f.time,
                interactive=f.interactive,
                written_before=f.written_before,
                dispatched=f.dispatched,
                first_token=f.first_token,
                asked_max_tokens=f.max_tokens,
                prefix_key=f.prefix_key,
                cached_tokens=f.cached_tokens,
            )
            for f in self._st.board.get(worker_id).facts.recent()
            if f.prompt_tokens is not None and f.output_tokens is not None and f.max_tokens is not None
        ]

    def queue_gate(self, worker_id: str) -> tuple[int, float] | None:
        return self._st.board.get(worker_id).target(self._dispatcher.band), self._gate_period_s

    def in_flight(self, worker_id: str) -> Sequence[InFlight]:
        return [
            InFlight(
                arrived=a.ticket.enqueued_at,
                prompt_tokens=a.ticket.prompt_tokens or 1,
                max_tokens=a.sent_max_tokens if a.sent_max_tokens is not None else a.ticket.max_tokens,
                interactive=a.ticket.priority is Priority.INTERACTIVE,
                keeps_written=a.on_take_back is not None,  # the relay reads a whole answer it can end early
                written_before=a.going_on_from,
                dispatched=a.dispatched_at,
                asked_max_tokens=a.ticket.max_tokens,
            )
            for a in self._st.board.get(worker_id).attempts
        ]

    def prefix_first(self, worker_id: str) -> int:
        return self._dispatcher.admission.prefix_first

    def prefixes_shared(self, worker_id: str) -> bool:
        return self._dispatcher.admission.prefixes.any_shared()

    def queue_sides(self, worker_id: str) -> tuple[int, int] | None:
        return self._st.board.get(worker_id).queue_sides(self._dispatcher.band)

    def keep_queue_past(self, worker_id: str, past: bool) -> None:
        self._st.board.get(worker_id).queue_past = past

    def hold_back_budget(self, worker_id: str, interactive: bool, asked: int, tokens: int | None) -> None:
        self._st.board.get(worker_id).output_budgets.hold_back((interactive, asked), tokens)

    def release_budget(self, worker_id: str, interactive: bool, asked: int) -> None:
        self._st.board.get(worker_id).output_budgets.release((interactive, asked))

    def hold_open(self, worker_id: str, most: int | None) -> None:
        self._st.board.get(worker_id).held_open = most


def _launched_running_limit(engine: Engine, info: WorkerInfo) -> int | None:
    """The most requests a worker runs at once as it was started (its ``max_running`` knob's argument),
    None where its arguments leave it to the engine (its server info tells, where it has one)."""
    knob = engine.knobs.get(KnobName.MAX_RUNNING)
    value = None if knob is None else info.args.get(knob.arg)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _control_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The controllers, one per pool (its own [control] settings, rolling restarts within the pool):
    built when the app starts, fed by the board, the pool's states and log lines. One journal.
    Behind several replicas (a :class:`ReplicaPool`) they run while this replica leads, and the
    pacing learns how many replicas share the workers."""
    st = app[PROXY]
    controlling = functools.partial(_controlling, st, app[CONTROL_CONSTANTS])
    if isinstance(st.pool, ReplicaPool):
        st.pool.follow_with(leading=controlling, replicas=st.board.set_replicas)
        st.launches_planned.set()  # the pool starts now: a leader plans its launches as it takes over
        yield
        return
    async with controlling():
        yield


@contextlib.asynccontextmanager
async def _controlling(st: ProxyState, constants: Constants) -> AsyncIterator[None]:
    """The controllers' life: built, tracking the workers, running until the block ends."""
    replica = f"{socket.gethostname()}:{st.policy.proxy.port}"  # its rows in a shared store's journal
    journal = await open_journal(st.policy.control.journal_path, st.policy.store.url, replica)
    # the planner's replays run in a process of their own (started at the first plan: none if no pool plans)
    async with PlanProcess() as planning:
        closed = False

        def is_closed() -> bool:
            return closed

        _build_controllers(st, journal, planning, constants)
        st.journal = journal
        _track_workers(st)
        _listen_to_workers(st, is_closed)
        tasks = _start_controllers(st)

        async def stop_control() -> None:
            """No decision from now on, none carried out (the shutdown's drain calls it first: no
            restart or revival while the requests in flight end)."""
            nonlocal closed
            closed = True
            await _stop_tasks(tasks)

        st.stop_control = stop_control
        try:
            yield
        finally:
            await stop_control()
            st.stop_control = None
            for controller in st.controllers.values():
                st.board.unsubscribe(controller.on_sample)
            await close_journal(journal)


def _build_controllers(st: ProxyState, journal: Journal, planning: PlanProcess, constants: Constants) -> None:
    """One controller per pool into ``st.controllers``, acting on the pool's workers through its dispatcher."""
    several = len(st.policy.pools) > 1
    for pool_settings in st.policy.pools:
        settings = pool_settings.control
        engine = pool_settings.engine.engine
        view = PoolView(st.pool, pool_settings.name) if several else st.pool
        rate = _clock_rate(pool_settings)
        st.controllers[pool_settings.name] = Controller(
            settings,
            engine.knobs,
            journal,
            engine=engine,
            surroundings=_Surroundings(
                st,
                st.requests.dispatcher_of(pool_settings.name),
                # the scraper's period on the worker's clock (its wall floor at the worker's rate)
                gate_period_s=max(pool_settings.pacing.scrape_interval_s, MIN_WALL_INTERVAL_S * rate),
            ),
            # only managed workers are acted on: for an external pool the controller advises, and its
            # journal entries say the worker is not managed by this proxy
            actor=_rollout(view, st.requests.dispatcher_of(pool_settings.name), constants.in_wall(rate)),
            clock=time.monotonic,
            hold=st.pool.hold,
            declare_down=st.pool.declare_down,
            modelled=functools.partial(_modelled, engine, pool_settings.engine.extra_args),
            choice_args=engine.choice_args,
            offload=planning,
            clock_rate=rate,
            constants=constants,
            placement=_placement(pool_settings),
        )


def _placement(pool: PoolSettings) -> Callable[[int], Mapping[str, object]] | None:
    """The engine's flags for a worker of the pool at a tp: what a reshape sets (None: a pool whose
    GPUs the proxy does not place, which is not reshaped)."""
    if pool.shorthand or not pool.engine.managed:
        return None
    return functools.partial(pool.engine.engine.placement_args, model=pool.model)


def _rollout(pool: RestartablePool, dispatcher: Drainable, wall: Constants) -> Rollout:
    """A pool's rolling restart, its drain's durations taken from ``wall``: the controller's constants
    on the wall clock of the pool's workers (``Constants.in_wall``)."""
    return Rollout(pool, dispatcher, drain_timeout_s=wall.drain_timeout_s, settle_s=wall.drain_settle_s)


def _track_workers(st: ProxyState) -> None:
    """The controllers track the workers the pool lists now; they plan each worker's first launch
    (the pool starts once ``st.launches_planned`` is set)."""
    for info in st.pool.workers():
        controller = st.controllers.get(info.pool)
        if controller is not None:
            controller.track(info)
    if isinstance(st.pool, PlannedLaunches):
        st.pool.plan_launches(functools.partial(_launch_args, st))
    st.launches_planned.set()


def _listen_to_workers(st: ProxyState, is_closed: Callable[[], bool]) -> None:
    """The pool's state changes and log lines, to the controllers until they stop; a worker that
    becomes ready has its server info read."""
    engines = {p.name: p.engine.engine for p in st.policy.pools}

    def on_state(info: WorkerInfo) -> None:
        controller = st.controllers.get(info.pool)
        if is_closed() or controller is None:
            return
        controller.track(info)
        if info.state is WorkerState.READY:  # an external worker's too: its clock rate is read there
            st.spawn(_read_server_info(st, engines, info, is_closed))

    def on_line(worker_id: str, line: str) -> None:
        if not is_closed():
            for controller in st.controllers.values():
                controller.on_line(worker_id, line)  # a controller reads only the workers it tracks

    st.pool.add_listener(on_state)
    if isinstance(st.pool, WorkerLogs):  # only a pool that starts its workers has their output
        st.pool.add_line_listener(on_line)


def _start_controllers(st: ProxyState) -> list[asyncio.Task[None]]:
    """Subscribe each controller to the board's samples and start its loop; returns the loops' tasks."""
    for controller in st.controllers.values():
        st.board.subscribe(controller.on_sample)  # a controller keeps only its own workers' samples
    for name, controller in st.controllers.items():
        k = controller.constants
        _log.info(
            "controller %s (pool %s): its workers' clock at %g x the wall's: looks every %g s over %g s windows",
            controller.mode,
            name,
            controller.clock_rate,
            k.interval_s,
            k.window_s,
        )
    return [asyncio.create_task(c.run(), name=f"pacer-controller-{n}") for n, c in st.controllers.items()]


async def _read_server_info(
    st: ProxyState, engines: Mapping[str, Engine], info: WorkerInfo, is_closed: Callable[[], bool]
) -> None:
    """What the engine chose for args left unset (``mem_fraction_static``...), from its server info
    (the controller's, for a worker it manages), and how many requests it runs at once (the
    pacing's, for every worker: its launch arguments first, its server info over them); the clock
    rate it tells goes to the pool's dispatcher and controller."""
    engine = engines.get(info.pool, st.policy.engine.engine)
    path = engine.server_info_path
    load = st.board.get(info.id)
    load.running_limit = _launched_running_limit(engine, info)
    if st.session is None or path is None:
        return
    payload = await _fetch_server_info(st.session, info, path)
    if payload is None or is_closed():
        return
    load.running_limit = engine.running_limit(payload) or load.running_limit
    rate = engine.clock_rate_from_server_info(payload)
    if rate is not None:  # the pool's window beside interactive work and its scrapes, on its workers' clock
        st.requests.dispatcher_of(info.pool).clock_rate = rate
        if (scraper := st.scrapers.get(info.pool)) is not None:
            scraper.clock_rate = rate
    controller = st.controllers.get(info.pool)
    if controller is not None and info.managed:
        controller.set_resolved(info.id, engine.resolved_from_server_info(payload))
        if rate is not None:
            controller.set_clock_rate(rate)


async def _fetch_server_info(session: aiohttp.ClientSession, info: WorkerInfo, path: str) -> dict[str, Any] | None:
    """The worker's server info (the JSON at ``path``), None when it does not answer with a JSON object."""
    try:
        async with session.get(info.url + path, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        _log.debug("no %s from %s: %s", path, info.id, exc)
        return None
    return payload if isinstance(payload, dict) else None


async def _stop_tasks(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait for each to end (what one raised on its way out is its own)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _modelled(engine: Engine, extra_args: Sequence[str], args: Mapping[str, object]) -> Modelled:
    return engine.modelled(args, extra_args)


def _clock_rate(pool: PoolSettings) -> float:
    """How fast a pool's workers' clock runs (engine seconds per wall second), as their launch
    arguments say (a simulated worker's time scale; 1 for a real engine or an external worker, whose
    server info may say otherwise once it is read)."""
    e = pool.engine
    return e.engine.modelled(e.args, e.extra_args).clock_rate if e.managed else 1.0


async def _launch_args(st: ProxyState, info: WorkerInfo) -> Mapping[str, object]:
    """A worker's first launch, as its pool's controller forecasts it. The GPU's total memory is
    NVML's on this host, read for engines that run on the host's GPUs (sampled now if the watch has
    not yet; a Ray worker's GPU is on another host: none)."""
    controller = st.controllers.get(info.pool)
    if controller is None:
        return info.args
    total: int | None = None
    engine = next((p.engine.engine for p in st.policy.pools if p.name == info.pool), st.policy.engine.engine)
    if st.gpus is not None and engine.uses_host_gpus and st.policy.fleet.backend is WorkerBackend.LOCAL:
        report = st.gpus.last
        if report is None:
            with contextlib.suppress(TimeoutError):
                report = await asyncio.wait_for(st.gpus.sample_once(), _LAUNCH_NVML_TIMEOUT_S)
        if report is not None and report.available:
            index = info.gpus[0] if info.gpus else 0
            total = next((d.memory_total_bytes for d in report.devices if d.index == index), None)
    return controller.launch_args(info.id, info.args, gpu_total_bytes=total)


def _batch_caller(st: ProxyState) -> Authenticate:
    """The Batch API's caller: the API key the proxy checks (any key of an open proxy owns its batches)."""

    def caller(request: web.Request) -> str:
        check_api_key(st.keys, request.headers)
        return bearer(request.headers) or ""

    return caller


async def _batch_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The Batch API's store and runner (``batch.dir``, or ``store.url``'s PostgreSQL): its lines go through the request path in
    the batch class; unfinished batches resume here."""
    st = app[PROXY]
    settings = st.policy.batch

    def accepts_model(model: str) -> bool:
        return not st.models.known or model in st.models.names

    names = {owner_of(key): caller.name for key, caller in st.keys.keys.items()}
    executor = RequestPathExecutor(
        st.requests,
        VALIDATORS,
        key_of_owner=lambda owner: names.get(owner, ANONYMOUS),
        max_body_bytes=st.policy.proxy.max_body_bytes,
    )
    async with BatchService.open(
        settings.dir,
        executor,
        concurrency=settings.concurrency,
        accepts_model=accepts_model,
        body_timeout_s=st.policy.proxy.body_timeout_s,
        store_url=st.policy.store.url,
    ) as service:
        app[BATCH_SERVICE] = service
        yield


async def _limits_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The per-key limits' store connection (a shared store); what they hold goes back at the end."""
    limits = app[PROXY].requests.limits
    await limits.start()
    yield
    await limits.close()


async def _drain(app: web.Application) -> None:
    """Shutdown, first step: queued requests get a 503 now; the requests in flight get
    ``proxy.shutdown_grace_s`` to end, then are ended (:class:`~proxy.server.drain.Drain`)."""
    st = app[PROXY]
    if st.stop_control is not None:
        await st.stop_control()  # no restart or revival while the requests end (take-backs: the dispatchers close)
    await st.drain.run(st.requests)


def stop_now(app: web.Application) -> bool:
    """A second signal: end the shutdown's drain at once (or make it end at once, not begun yet).
    False when the drain is over (the workers are stopping)."""
    return app[PROXY].drain.stop_now()


async def _start_pool(st: ProxyState) -> None:
    try:
        # the controllers' lifecycle plans each worker's first launch; it starts right after this
        # lifecycle without awaiting anything, so the pool still lists its workers once the app is up
        await st.launches_planned.wait()
        await st.pool.start()
    except Exception:
        _log.exception("starting the workers failed")


def _on_scrape(
    st: ProxyState, dispatcher: Dispatcher, worker_id: str, _sample: Sample | None, error: str | None
) -> None:
    """A scrape of one of ``dispatcher``'s workers: count a failure, run that pool's gate."""
    if error is not None:
        st.metrics.scrape_errors.labels(worker_id).inc()
    dispatcher.pump()


# aiohttp's own shutdown_timeout, after the drain: what a handler still open then gets before it is
# cancelled (twice this at most); one in the request path was ended by the drain and ends at once
HANDLERS_AFTER_DRAIN_S = 2.0


def make_runner(app: web.Application) -> web.AppRunner:
    """Serves with :class:`~proxy.server.protocol.EdgeRunner`: JSON refusals, a header deadline, the
    requests it answers counted for the drain."""
    st = app[PROXY]
    return EdgeRunner(
        app,
        header_timeout_s=st.policy.proxy.header_timeout_s,
        open_requests=st.drain.open_requests,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=HANDLERS_AFTER_DRAIN_S,
    )


class CannotListen(Exception):
    """The proxy's address cannot be bound (in use, or not this host's): nothing was started."""


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` to stop) and the bound port.

    The address is bound first: :class:`CannotListen` when it cannot be, before the app (its
    workers) starts."""
    try:
        listener = await Listener.bind(host, port, backlog=4096)
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()  # "address already in use", or a name that does not resolve
        raise CannotListen(f"cannot listen on {host}:{port}: {why}") from exc
    runner = make_runner(app)
    try:
        await runner.setup()
        await ListenerSite(runner, listener, host).start()
    except BaseException:
        try:
            await runner.cleanup()
        finally:
            listener.close()
        raise
    return runner, listener.port


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` (0: a free port) for the block, which gets the bound port; on
    exit stop it: the drain, then its lifecycles (the workers stop). Raises :class:`CannotListen`,
    with nothing started, when the address cannot be bound."""
    runner, bound = await serve(app, host, port)
    try:
        yield bound
    finally:
        await runner.cleanup()
