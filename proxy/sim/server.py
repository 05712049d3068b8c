"""The simulated SGLang server over HTTP (aiohttp): the engine driver plus SGLang 0.5.23's endpoints.

The driver task runs the engine in real time: plan a step, sleep its duration (modelled seconds /
``--sim-time-scale``, scheduled against the loop clock so Python's own overhead is absorbed, not
added), complete it, wake the requests it touched. Streaming handlers write one SSE chunk per
token; a disconnect aborts the request in the engine.

Endpoints: ``/health``, ``/health_generate`` (503 while starting), ``/ready``, ``/model_info``,
``/server_info`` (and the deprecated ``/get_model_info``, ``/get_server_info``), ``/v1/loads``,
``/metrics`` (``--enable-metrics`` only), ``/generate``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models[/{model}]``, ``/abort_request``, ``/flush_cache``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import Any, Callable

import orjson
from aiohttp import web

from proxy.sim import logs
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine, QueueFull
from proxy.sim.metrics import SimMetrics
from proxy.sim.protocol import BadRequest, GenParams, parse_chat, parse_completion, parse_generate
from proxy.sim.request import Req, State
from proxy.sim.steptime import graph_batch_sizes, startup_seconds
from proxy.sim.tokenizer import output_text, output_token_ids

VERSION = "0.5.23"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
OPEN_PATHS = ("/health", "/ready", "/metrics")
GEN_THROUGHPUT_STALENESS_S = 30.0
MAX_CATCH_UP_S = 0.5  # later than this behind the modelled clock, the server stops catching up


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    return _json({"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status)


def native_error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status)


class Handle:
    """The HTTP side of one request: how to wake its handler."""

    __slots__ = ("fut", "streaming")

    def __init__(self, streaming: bool) -> None:
        self.fut: asyncio.Future[None] | None = None
        self.streaming = streaming

    def wake(self) -> None:
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(None)


class SimServer:
    def __init__(self, cfg: SimConfig, sink: logs.LogSink, on_death: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.sink = sink
        self.engine = Engine(cfg, log=self._engine_log)
        self.metrics = SimMetrics(cfg) if cfg.enable_metrics else None
        self.on_death = on_death
        self.ready = False
        self.dead: asyncio.Future[int] | None = None
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._stats_dirty = False
        self._last_step_end = 0.0
        self.busy_modelled_s = 0.0  # engine-clock seconds of steps run
        self.busy_wall_s = 0.0  # wall seconds those steps took
        self.max_late_s = 0.0  # the latest a step completed after its modelled end
        self.start_wall = time.time()
        self._retract_seen = (0, 0, 0)

    # ------------------------------------------------------------------ engine driver
    def now(self) -> float:
        return time.monotonic() - self._t0

    def _engine_log(self, level: str, msg: str) -> None:
        self._stats_dirty = True
        self.sink(level, msg)

    def kick(self) -> None:
        self._wake.set()

    async def drive(self) -> None:
        """Steps follow each other on the modelled clock: a step starts when the previous one ended
        (in modelled time), not when this coroutine got the CPU back, so time spent delivering tokens
        is absorbed while it stays below a step's duration instead of adding up."""
        eng = self.engine
        prev_end: float | None = None  # modelled end of the previous step, while busy
        prev_wake = 0.0
        while True:
            now = self.now()
            chained = prev_end is not None and now - prev_end <= MAX_CATCH_UP_S
            start = max(prev_end if chained else now, eng.now)  # type: ignore[type-var]
            step = eng.plan(start)
            if step is None:
                prev_end = None
                self._refresh_stats()
                self._wake.clear()
                await self._wake.wait()
                continue
            if step.oom is not None:
                self._die_oom(step.oom, step.need_mib)
                return
            end = start + step.duration
            delay = end - self.now()
            await asyncio.sleep(delay if delay > 0 else 0)
            wake = self.now()
            t = end
            self.busy_modelled_s += step.duration
            self.busy_wall_s += wake - (prev_wake if chained else now)
            self.max_late_s = max(self.max_late_s, wake - end)
            prev_end, prev_wake = end, wake
            outcome = eng.complete(step, t)
            m = self.metrics
            for r in outcome.started:
                if r.handle is not None:
                    r.handle.wake()
                if m is not None and r.num_retractions == 0:
                    m.on_first_token(r.first_token_time - r.arrival, r.stream)  # type: ignore[operator]
            if outcome.decoded:
                if m is not None:
                    m.itl.observe(t - self._last_step_end, outcome.decoded)
                for r in eng.running:
                    h = r.handle
                    if h is not None and h.streaming:
                        h.wake()
            for r in outcome.finished:
                self._finished(r)
            self._last_step_end = t
            if self._stats_dirty:
                self._refresh_stats()

    def _finished(self, r: Req) -> None:
        if r.handle is not None:
            r.handle.wake()
        if self.metrics is not None:
            aborted = bool(r.finish_reason and r.finish_reason.get("type") == "abort")
            self.metrics.on_finish(prompt_tokens=r.prompt_len, output_tokens=r.out_base, cached_tokens=r.cached_tokens,
                                   e2e=(r.finish_time or 0.0) - r.arrival, streaming=r.stream, aborted=aborted)

    def _refresh_stats(self) -> None:
        self._stats_dirty = False
        m, eng = self.metrics, self.engine
        if m is None:
            return
        seen = (eng.retracted_total, eng.retracted_input_tokens, eng.retracted_output_tokens)
        if seen != self._retract_seen:
            m.on_retract(*(a - b for a, b in zip(seen, self._retract_seen)))
            self._retract_seen = seen
        m.set_load(running=eng.n_run, queue=len(eng.waiting), usage=eng.token_usage, used=eng.num_used_tokens,
                   available=eng.available, evictable=eng.cache.evictable_size, ratio=eng.ratio,
                   gen_throughput=eng.last_gen_throughput, cache_hit_rate=eng.last_cache_hit_rate,
                   seq_lens=eng.kv_tokens_running, cuda_graph=eng.last_cuda_graph, retracted_now=eng.last_retracted)

    def _die_oom(self, phase: str, need_mib: float) -> None:
        mem = self.cfg.memory
        self.sink("error", logs.cuda_oom_traceback(phase=phase, need_mib=need_mib, total_mib=mem.total_mib,
                                                   free_mib=mem.available_mib, used_mib=mem.total_mib - mem.available_mib))
        self.sink("error", logs.SIGQUIT_LINE)
        if self.dead is not None and not self.dead.done():
            self.dead.set_result(1)
        if self.on_death is not None:
            self.on_death(1)

    # ------------------------------------------------------------------ start-up
    async def start_up(self) -> None:
        cfg, mem, say = self.cfg, self.cfg.memory, self.sink
        load_s, capture_s, total_s = startup_seconds(cfg.weights_bytes, cfg.cuda_graph_max_bs_decode)
        k = cfg.startup_wall_seconds / total_s if total_s > 0 else 0.0  # real seconds per modelled second
        free0 = (mem.total_mib - mem.context_mib) / 1024
        say("info", f"server_args=ServerArgs(model_path='{cfg.model_path}', served_model_name='{cfg.served_model_name}', "
                    f"host='{cfg.host}', port={cfg.port}, mem_fraction_static={cfg.mem_fraction_static}, "
                    f"max_running_requests={cfg.max_running_requests}, max_queued_requests={cfg.max_queued_requests}, "
                    f"max_total_tokens={cfg.server_args.get('max_total_tokens')}, "
                    f"chunked_prefill_size={cfg.chunked_prefill_size or -1}, max_prefill_tokens={cfg.max_prefill_tokens}, "
                    f"schedule_policy='{cfg.schedule_policy}', schedule_conservativeness={cfg.schedule_conservativeness}, "
                    f"cuda_graph_max_bs_decode={cfg.cuda_graph_max_bs_decode}, enable_metrics={cfg.enable_metrics}, "
                    f"decode_log_interval={cfg.decode_log_interval}, context_length={cfg.context_len})")
        await asyncio.sleep(k * (total_s - load_s - capture_s - 1.0))
        say("info", f"Load weight begin. avail mem={free0:.2f} GB")
        await asyncio.sleep(k * load_s)
        after_w = free0 - mem.weights_mib / 1024
        say("info", f"Load weight end. type={cfg.model.architecture}, dtype=torch.bfloat16, avail mem={after_w:.2f} GB, "
                    f"mem usage={mem.weights_mib / 1024:.2f} GB.")
        kv_half = mem.kv_pool_mib / 2048
        say("info", f"KV Cache is allocated. #tokens: {cfg.max_total_num_tokens}, K size: {kv_half:.2f} GB, "
                    f"V size: {kv_half:.2f} GB")
        after_kv = after_w - mem.kv_pool_mib / 1024
        say("info", f"Memory pool end. avail mem={after_kv:.2f} GB")
        if cfg.cuda_graph_max_bs_decode > 0:
            say("info", f"Capture cuda graph begin. This can take up to several minutes. avail mem={after_kv:.2f} GB")
            say("info", f"Capture cuda graph bs {graph_batch_sizes(cfg.cuda_graph_max_bs_decode)}")
            await asyncio.sleep(k * capture_s)
            say("info", f"Capture cuda graph end. Time elapsed: {capture_s:.2f} s. mem usage={mem.graph_mib / 1024:.2f} GB. "
                        f"avail mem={mem.available_gb:.2f} GB.")
        if cfg.max_total_num_tokens < cfg.context_len:
            say("warning", f"KV pool holds {cfg.max_total_num_tokens} tokens, fewer than --context-length "
                           f"{cfg.context_len}. Requests longer than the pool are rejected.")
        say("info", logs.startup_line(
            max_total_num_tokens=cfg.max_total_num_tokens, chunked_prefill_size=cfg.chunked_prefill_size or -1,
            max_prefill_tokens=cfg.max_prefill_tokens, max_running_requests=cfg.max_running_requests,
            context_len=cfg.context_len, available_gpu_mem_gb=mem.available_gb))
        await asyncio.sleep(k * 1.0)  # warm-up request
        self.ready = True
        say("info", logs.READY_LINE)

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024**2)
        r = app.router
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
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model:.+}", self.model_card)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        key = self.cfg.api_key
        if key and not request.path.startswith(OPEN_PATHS):
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.cfg
        return _json({"model_path": cfg.model_path, "served_model_name": cfg.served_model_name,
                      "tokenizer_path": cfg.server_args.get("tokenizer_path") or cfg.model_path, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default", "load_format": "auto",
                      "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                      "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
                      "architectures": [cfg.model.architecture]})

    def internal_state(self) -> dict[str, Any]:
        cfg, eng, mem = self.cfg, self.engine, self.cfg.memory
        return {"effective_max_running_requests_per_dp": cfg.max_running_requests,
                "last_gen_throughput": eng.last_gen_throughput,
                "memory_usage": {"weight": round(mem.weights_mib / 1024, 2), "kv_cache": round(mem.kv_pool_mib / 1024, 2),
                                 "graph": round(mem.graph_mib / 1024, 2), "token_capacity": cfg.max_total_num_tokens},
                "world_size": 1, "new_token_ratio": eng.ratio, "num_retracted_reqs_total": eng.retracted_total,
                "sim": {"gpu": cfg.gpu.name, "model": cfg.model.name, "time_scale": cfg.time_scale,
                        "busy_modelled_s": self.busy_modelled_s, "busy_wall_s": self.busy_wall_s, "max_late_s": self.max_late_s,
                        "decode_steps": eng.decode_steps, "generated_tokens": eng.generated_tokens}}

    async def server_info(self, request: web.Request) -> web.Response:
        body = {k: v for k, v in self.cfg.server_args.items()}
        body.update(startup_time=self.start_wall, internal_states=[self.internal_state()], version=VERSION,
                    frontend="python", status="ready" if self.ready else "starting")
        return web.Response(body=orjson.dumps(body, default=str), content_type="application/json")

    def load_snapshot(self) -> dict[str, Any]:
        eng, cfg = self.engine, self.cfg
        return {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": eng.n_run,
                "num_waiting_reqs": len(eng.waiting), "num_waiting_uncached_tokens": max(0, eng.waiting_tokens),
                "num_used_tokens": eng.num_used_tokens, "num_total_tokens": cfg.max_total_num_tokens,
                "num_active_tokens": eng.kv_tokens_running, "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": cfg.max_total_num_tokens, "max_running_requests": cfg.max_running_requests,
                "token_usage": round(eng.token_usage, 4), "gen_throughput": eng.last_gen_throughput,
                "cache_hit_rate": eng.last_cache_hit_rate, "utilization": 1.0 if eng.n_run else 0.0,
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None}

    async def loads(self, request: web.Request) -> web.Response:
        snap = self.load_snapshot()
        if request.query.get("format") == "prometheus":
            lines = [f'sglang_{k}{{dp_rank="0"}} {float(v)}' for k, v in snap.items()
                     if k not in ("dp_rank", "timestamp") and isinstance(v, (int, float))]
            return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
        snap["queues"] = {"waiting": len(self.engine.waiting), "grammar": 0, "paused": 0, "retracted": 0,
                          "prealloc_ready": 0}
        return _json({"timestamp": snap["timestamp"], "version": VERSION, "accelerator": self.cfg.gpu.label,
                      "num_accelerators": 1, "loads": [snap]})

    async def metrics_page(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        if self.now() - self.engine.last_decode_log_time > GEN_THROUGHPUT_STALENESS_S:
            self.metrics.gen_throughput_stale()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.served_model_name:
            return openai_error(f"The model '{name}' does not exist.", 404, "NotFoundError")
        return _json(self._card())

    def _card(self) -> dict[str, Any]:
        name = self.cfg.served_model_name
        return {"id": name, "object": "model", "created": int(self.start_wall), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.cfg.context_len}

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
            self._abort(r, "Abort request.")
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                     "(When there are running or waiting requests, the operation will not be performed.)\n")
        return web.Response(status=400, text="Cache not flushed. Please check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will not be performed.)\n")

    # ------------------------------------------------------------------ generation
    def _submit(self, p: GenParams) -> Req:
        r = self.engine.add(prompt_ids=p.prompt_ids, max_new_tokens=p.max_new_tokens, ignore_eos=p.ignore_eos,
                            output_len=p.output_len, rid=p.rid, stream=p.stream, now=self.now())
        r.handle = Handle(p.stream)
        self.kick()
        return r

    def _abort(self, r: Req, message: str) -> None:
        if self.engine.abort(r, message):
            self._finished(r)
            self.kick()

    async def _wait(self, r: Req) -> None:
        h = r.handle
        h.fut = asyncio.get_running_loop().create_future()
        await h.fut

    async def _run_to_end(self, r: Req) -> None:
        try:
            while r.state is not State.FINISHED:
                await self._wait(r)
        finally:
            if r.state is not State.FINISHED:  # the client went away
                self._abort(r, "The client disconnected.")

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=orjson.loads)
        except ValueError as exc:
            raise BadRequest(f"The request body is not valid JSON: {exc}") from None

    def _check_ready(self) -> None:
        if not self.ready:
            raise BadRequest("The server is starting up; retry when /health returns 200.", 503)

    def meta(self, r: Req, n: int) -> dict[str, Any]:
        reason = r.finish_reason if r.state is State.FINISHED else None
        meta: dict[str, Any] = {"id": r.rid, "finish_reason": reason, "prompt_tokens": r.prompt_len,
                                "completion_tokens": n, "cached_tokens": r.cached_tokens, "reasoning_tokens": 0,
                                "weight_version": "default", "num_retractions": r.num_retractions}
        if reason is not None:
            meta["e2e_latency"] = (r.finish_time or 0.0) - r.arrival
        return meta

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            self._check_ready()
            params, batch = parse_generate(await self._read_json(request), self.cfg)
        except BadRequest as exc:
            return native_error(exc.message, exc.status)
        if params[0].stream:
            return await self._generate_stream(request, params[0])
        try:
            reqs = [self._submit(p) for p in params]
        except QueueFull as exc:
            return _json({"detail": exc.message}, 503)
        await asyncio.gather(*(self._run_to_end(r) for r in reqs))
        outs = []
        for r in reqs:
            if r.finish_reason and r.finish_reason.get("type") == "abort" and r.finish_reason.get("status_code", 0) >= 500:
                return _json({"detail": r.finish_reason["message"]}, int(r.finish_reason["status_code"]))
            n = r.out_base
            outs.append({"text": output_text(r.token_seed, 0, n), "output_ids": output_token_ids(r.token_seed, 0, n),
                         "meta_info": self.meta(r, n)})
        return _json(outs if batch else outs[0])

    async def _generate_stream(self, request: web.Request, p: GenParams) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            r = self._submit(p)
        except QueueFull as exc:
            await resp.write(b"data: " + orjson.dumps({"error": {"message": exc.message, "type": "invalid_request_error",
                                                                 "code": 503, "retryable": True}}) + b"\n\ndata: [DONE]\n\n")
            return resp
        sent, text = 0, ""
        try:
            while True:
                n = self.engine.output_len(r)
                finished = r.state is State.FINISHED
                while sent < n:
                    text += output_text(r.token_seed, sent, sent + 1)
                    sent += 1
                    last = finished and sent == n
                    meta = self.meta(r, sent) if last else self._running_meta(r, sent)
                    await resp.write(b"data: " + orjson.dumps({"text": text, "meta_info": meta}) + b"\n\n")
                if finished:
                    if n == 0 or (r.finish_reason or {}).get("type") == "abort":
                        await resp.write(b"data: " + orjson.dumps({"text": text, "meta_info": self.meta(r, n)}) + b"\n\n")
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                await self._wait(r)
        finally:
            if r.state is not State.FINISHED:
                self._abort(r, "The client disconnected.")

    @staticmethod
    def _running_meta(r: Req, n: int) -> dict[str, Any]:
        return {"id": r.rid, "finish_reason": None, "prompt_tokens": r.prompt_len, "completion_tokens": n,
                "cached_tokens": r.cached_tokens, "reasoning_tokens": 0, "weight_version": "default",
                "num_retractions": r.num_retractions}

    def _usage(self, reqs: list[Req]) -> dict[str, Any]:
        prompt = sum(r.prompt_len for r in reqs)
        completion = sum(r.out_base for r in reqs)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion, "prompt_tokens_details": None}
        if self.cfg.enable_cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(r.cached_tokens for r in reqs)}
        return usage

    @staticmethod
    def _openai_finish(r: Req) -> tuple[str | None, Any]:
        reason = r.finish_reason or {}
        kind = reason.get("type")
        if kind == "stop":
            return "stop", reason.get("matched")
        if kind == "length":
            return "length", None
        return ("abort" if kind == "abort" else None), None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            self._check_ready()
            body = await self._read_json(request)
            params = [parse_chat(body, self.cfg)] if chat else parse_completion(body, self.cfg)
        except BadRequest as exc:
            return openai_error(exc.message, exc.status,
                                "BadRequestError" if exc.status < 500 else "ServiceUnavailableError")
        model = body.get("model") or self.cfg.served_model_name
        if params[0].stream:
            return await self._openai_stream(request, params[0], chat=chat, model=model)
        try:
            reqs = [self._submit(p) for p in params]
        except QueueFull as exc:
            return openai_error(exc.message, 503, "ServiceUnavailableError")
        await asyncio.gather(*(self._run_to_end(r) for r in reqs))
        for r in reqs:
            reason = r.finish_reason or {}
            if reason.get("type") == "abort" and reason.get("status_code", 0) >= 500:
                return openai_error(str(reason.get("message")), int(reason["status_code"]), "InternalServerError")
        choices = []
        for i, r in enumerate(reqs):
            finish, matched = self._openai_finish(r)
            text = output_text(r.token_seed, 0, r.out_base)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                                        "tool_calls": None}, "logprobs": None,
                                "finish_reason": finish, "matched_stop": matched})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish,
                                "matched_stop": matched})
        return _json({"id": reqs[0].rid, "object": "chat.completion" if chat else "text_completion",
                      "created": int(time.time()), "model": model, "choices": choices, "usage": self._usage(reqs)})

    async def _openai_stream(self, request: web.Request, p: GenParams, *, chat: bool, model: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            r = self._submit(p)
        except QueueFull as exc:
            err = {"object": "error", "message": exc.message, "type": "ServiceUnavailableError", "param": None, "code": 503}
            await resp.write(b"data: " + orjson.dumps({"error": err}) + b"\n\ndata: [DONE]\n\n")
            return resp
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": r.rid, "object": obj, "created": created, "model": model,
                                             "choices": [choice] if choice else [], "usage": usage}) + b"\n\n"

        sent = 0
        try:
            if chat:
                await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}))
            while True:
                n = self.engine.output_len(r)
                finished = r.state is State.FINISHED
                while sent < n:
                    piece = output_text(r.token_seed, sent, sent + 1)
                    sent += 1
                    if chat:
                        choice = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
                    await resp.write(chunk(choice))
                if finished:
                    finish, matched = self._openai_finish(r)
                    if chat:
                        final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
                    else:
                        final = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish, "matched_stop": matched}
                    await resp.write(chunk(final))
                    if p.include_usage:
                        await resp.write(chunk({}, self._usage([r])))
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                await self._wait(r)
        finally:
            if r.state is not State.FINISHED:
                self._abort(r, "The client disconnected.")


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
    server.dead = loop.create_future()
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
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(0))
        except (NotImplementedError, RuntimeError):
            pass
    tasks = [asyncio.create_task(server.start_up()), asyncio.create_task(server.drive())]
    try:
        done, _ = await asyncio.wait([stop, server.dead], return_when=asyncio.FIRST_COMPLETED)
        code = next(iter(done)).result()
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


__all__ = ["Handle", "SimServer", "run_server", "serve"]
