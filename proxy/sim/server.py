"""The simulated SGLang server over HTTP (aiohttp): SGLang 0.5.23's endpoints around the driver.

Endpoints: ``/health``, ``/health_generate`` (503 while starting), ``/ready``, ``/model_info``,
``/server_info`` (and the deprecated ``/get_model_info``, ``/get_server_info``), ``/v1/loads``,
``/metrics`` (``--enable-metrics`` only), ``/v1/models[/{model}]``, ``/abort_request``,
``/flush_cache``; generation (``/generate``, ``/v1/completions``, ``/v1/chat/completions``) lives in
:mod:`proxy.sim.generation`. ``/metrics``, ``/health*`` and ``/ready`` need no API key, as in SGLang.

The port is bound before start-up begins (``--port 0`` picks a free one; the ``Uvicorn running on``
line names it). A CUDA out-of-memory kills the process (exit code 1) after SGLang's lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from aiohttp import web

from proxy.sim import logs
from proxy.sim.config import SimConfig
from proxy.sim.driver import Driver
from proxy.sim.generation import Generation, json_response, native_error, openai_error
from proxy.sim.metrics import SimMetrics
from proxy.sim.startup import start_up

VERSION = "0.5.23"
OPEN_PATHS = ("/health", "/ready", "/metrics")


class SimServer:
    def __init__(self, cfg: SimConfig, sink: logs.LogSink, on_death: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.driver = Driver(cfg, sink, on_death)
        self.engine = self.driver.engine
        self.metrics: SimMetrics | None = self.driver.metrics
        self.generation = Generation(self.driver)
        self.start_wall = time.time()

    async def start_up(self) -> None:
        await start_up(self.cfg, self.driver.sink)
        self.driver.ready = True

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024**2)
        r, gen = app.router, self.generation
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.health)
        r.add_get("/ping", self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/loads", self.loads)
        if self.metrics is not None:
            r.add_get("/metrics", self.metrics_page)
        r.add_route("POST", "/generate", gen.generate)
        r.add_route("PUT", "/generate", gen.generate)
        r.add_post("/v1/completions", gen.completions)
        r.add_post("/v1/chat/completions", gen.chat)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model:.+}", self.model_card)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        key = self.cfg.api_key
        if (
            key
            and not request.path.startswith(OPEN_PATHS)
            and request.headers.get("Authorization", "") != f"Bearer {key}"
        ):
            return json_response({"error": "Unauthorized"}, 401)
        response: web.StreamResponse = await handler(request)
        return response

    async def health(self, request: web.Request) -> web.Response:
        if not self.driver.ready:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.cfg
        return json_response(
            {
                "model_path": cfg.model_path,
                "served_model_name": cfg.served_model_name,
                "tokenizer_path": cfg.server_args.get("tokenizer_path") or cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": [cfg.model.architecture],
            }
        )

    def internal_state(self) -> dict[str, Any]:
        cfg, eng, mem = self.cfg, self.engine, self.cfg.memory
        return {
            "effective_max_running_requests_per_dp": cfg.max_running_requests,
            "last_gen_throughput": eng.last_gen_throughput,
            "memory_usage": {
                "weight": round(mem.weights_mib / 1024, 2),
                "kv_cache": round(mem.kv_pool_mib / 1024, 2),
                "graph": round(mem.graph_mib / 1024, 2),
                "token_capacity": cfg.max_total_num_tokens,
            },
            "world_size": 1,
            "new_token_ratio": eng.ratio,
            "num_retracted_reqs_total": eng.retracted_total,
            "sim": {
                "gpu": cfg.gpu.name,
                "model": cfg.model.name,
                "time_scale": cfg.time_scale,
                "busy_modelled_s": self.driver.busy_modelled_s,
                "busy_wall_s": self.driver.busy_wall_s,
                "max_late_s": self.driver.max_late_s,
                "decode_steps": eng.decode_steps,
                "generated_tokens": eng.generated_tokens,
            },
        }

    async def server_info(self, request: web.Request) -> web.Response:
        body = {k: v for k, v in self.cfg.server_args.items()}
        body.update(
            startup_time=self.start_wall,
            internal_states=[self.internal_state()],
            version=VERSION,
            frontend="python",
            status="ready" if self.driver.ready else "starting",
        )
        return web.Response(body=orjson.dumps(body, default=str), content_type="application/json")

    def load_snapshot(self) -> dict[str, Any]:
        eng, cfg = self.engine, self.cfg
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": eng.n_run,
            "num_waiting_reqs": len(eng.waiting),
            "num_waiting_uncached_tokens": max(0, eng.waiting_tokens),
            "num_used_tokens": eng.num_used_tokens,
            "num_total_tokens": cfg.max_total_num_tokens,
            "num_active_tokens": eng.kv_tokens_running,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_running_requests": cfg.max_running_requests,
            "token_usage": round(eng.token_usage, 4),
            "gen_throughput": eng.last_gen_throughput,
            "cache_hit_rate": eng.last_cache_hit_rate,
            "utilization": 1.0 if eng.n_run else 0.0,
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }

    async def loads(self, request: web.Request) -> web.Response:
        snap = self.load_snapshot()
        if request.query.get("format") == "prometheus":
            lines = [
                f'sglang_{k}{{dp_rank="0"}} {float(v)}'
                for k, v in snap.items()
                if k not in ("dp_rank", "timestamp") and isinstance(v, (int, float))
            ]
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
        snap["queues"] = {
            "waiting": len(self.engine.waiting),
            "grammar": 0,
            "paused": 0,
            "retracted": 0,
            "prealloc_ready": 0,
        }
        return json_response(
            {
                "timestamp": snap["timestamp"],
                "version": VERSION,
                "accelerator": self.cfg.gpu.label,
                "num_accelerators": 1,
                "loads": [snap],
            }
        )

    async def metrics_page(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        if self.driver.gen_throughput_stale():
            self.metrics.gen_throughput_stale()
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.served_model_name:
            return openai_error(f"The model '{name}' does not exist.", 404, "NotFoundError")
        return json_response(self._card())

    def _card(self) -> dict[str, Any]:
        name = self.cfg.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(self.start_wall),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.cfg.context_len,
        }

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return native_error("The request body must be JSON.")
        if not isinstance(body, dict):
            return native_error("The request body must be a JSON object.")
        eng = self.engine
        if body.get("abort_all"):
            victims = [*eng.waiting, *eng.running] + ([eng.chunked] if eng.chunked else [])
        else:
            rid = body.get("rid")
            victims = [r for r in (*eng.waiting, *eng.running, *([eng.chunked] if eng.chunked else [])) if r.rid == rid]
        for r in victims:
            self.driver.abort(r, "Abort request.")
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(
            status=400,
            text="Cache not flushed. Please check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
        )


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(cfg: SimConfig, sink: logs.LogSink, on_death: Callable[[int], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT (returns 0) or death (returns 1)."""
    loop = asyncio.get_running_loop()
    server = SimServer(cfg, sink, on_death)
    server.driver.dead = loop.create_future()
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    sink.plain(f"INFO:     Started server process [{os.getpid()}]")
    sink.plain("INFO:     Waiting for application startup.")
    sink.plain("INFO:     Application startup complete.")
    sink.plain(f"INFO:     Uvicorn running on http://{cfg.host}:{port} (Press CTRL+C to quit)")
    stop = loop.create_future()

    def request_stop() -> None:
        if not stop.done():
            stop.set_result(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, request_stop)
    tasks = [asyncio.create_task(server.start_up()), asyncio.create_task(server.driver.drive())]
    for task in tasks:
        task.add_done_callback(server.driver.on_task_done)
    try:
        done, _ = await asyncio.wait([stop, server.driver.dead], return_when=asyncio.FIRST_COMPLETED)
        code: int = next(iter(done)).result()
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()
    return code


def run_server(cfg: SimConfig, sink: logs.LogSink) -> int:
    def die(code: int) -> None:  # a real server's process tree is killed: no graceful shutdown
        try:
            sink.stream.flush()
        finally:
            os._exit(code)

    run: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    try:
        return run(serve(cfg, sink, on_death=die))
    except OSError as exc:
        sink("error", f"Failed to bind {cfg.host}:{cfg.port}: {exc}")
        return 1


__all__ = ["SimServer", "run_server", "serve"]
