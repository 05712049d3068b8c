"""The engine in real time: the driver task, and the bridge between HTTP handlers and the engine.

The driver plans a step, sleeps its duration (modelled seconds / ``--sim-time-scale``), completes it
and wakes the requests it touched. Steps follow each other on the modelled clock: a step starts when
the previous one ended in modelled time, not when the driver got the CPU back, so the time spent
delivering tokens is absorbed (while it stays under a step's duration) instead of adding up.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable

from proxy.sim import logs
from proxy.sim.config import SimConfig
from proxy.sim.engine import Engine
from proxy.sim.metrics import SimMetrics
from proxy.sim.protocol import GenParams
from proxy.sim.request import Req, State

GEN_THROUGHPUT_STALENESS_S = 30.0
MAX_CATCH_UP_S = 0.5  # later than this behind the modelled clock, the driver stops catching up


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


class Driver:
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
        self._retract_seen = (0, 0, 0)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _engine_log(self, level: str, msg: str) -> None:
        self._stats_dirty = True
        self.sink(level, msg)

    def kick(self) -> None:
        self._wake.set()

    async def drive(self) -> None:
        eng = self.engine
        prev_end: float | None = None  # modelled end of the previous step, while busy
        prev_wake = 0.0
        while True:
            now = self.now()
            if prev_end is not None and now - prev_end <= MAX_CATCH_UP_S:
                chained, start = True, max(prev_end, eng.now)
            else:
                chained, start = False, max(now, eng.now)
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
            self.metrics.on_finish(
                prompt_tokens=r.prompt_len,
                output_tokens=r.out_base,
                cached_tokens=r.cached_tokens,
                e2e=(r.finish_time or 0.0) - r.arrival,
                streaming=r.stream,
                aborted=aborted,
            )

    def _refresh_stats(self) -> None:
        self._stats_dirty = False
        m, eng = self.metrics, self.engine
        if m is None:
            return
        seen = (eng.retracted_total, eng.retracted_input_tokens, eng.retracted_output_tokens)
        if seen != self._retract_seen:
            m.on_retract(*(a - b for a, b in zip(seen, self._retract_seen, strict=True)))
            self._retract_seen = seen
        m.set_load(
            running=eng.n_run,
            queue=len(eng.waiting),
            usage=eng.token_usage,
            used=eng.num_used_tokens,
            available=eng.available,
            evictable=eng.cache.evictable_size,
            ratio=eng.ratio,
            gen_throughput=eng.last_gen_throughput,
            cache_hit_rate=eng.last_cache_hit_rate,
            seq_lens=eng.kv_tokens_running,
            cuda_graph=eng.last_cuda_graph,
            retracted_now=eng.last_retracted,
        )

    def _die_oom(self, phase: str, need_mib: float) -> None:
        mem = self.cfg.memory
        self.sink(
            "error",
            logs.cuda_oom_traceback(
                phase=phase,
                need_mib=need_mib,
                total_mib=mem.total_mib,
                free_mib=mem.available_mib,
                used_mib=mem.total_mib - mem.available_mib,
            ),
        )
        self.sink("error", logs.SIGQUIT_LINE)
        if self.dead is not None and not self.dead.done():
            self.dead.set_result(1)
        if self.on_death is not None:
            self.on_death(1)

    def submit(self, p: GenParams) -> Req:
        r = self.engine.add(
            prompt_ids=p.prompt_ids,
            max_new_tokens=p.max_new_tokens,
            ignore_eos=p.ignore_eos,
            output_len=p.output_len,
            rid=p.rid,
            stream=p.stream,
            priority=p.priority if self.engine.cfg.enable_priority_scheduling else None,
            now=self.now(),
        )
        r.handle = Handle(p.stream)
        self.kick()
        return r

    def abort(self, r: Req, message: str) -> None:
        if self.engine.abort(r, message):
            self._finished(r)
            self.kick()

    async def wait(self, r: Req, seen: int | None = None) -> None:
        """Until the engine touches ``r`` again; at once if it finished or got past ``seen`` tokens
        meanwhile (a wake that came while the handler was writing is not lost)."""
        if r.state is State.FINISHED or (seen is not None and self.engine.output_len(r) != seen):
            return
        h = r.handle
        h.fut = asyncio.get_running_loop().create_future()
        await h.fut

    async def run_to_end(self, r: Req) -> None:
        try:
            while r.state is not State.FINISHED:
                await self.wait(r)
        finally:
            if r.state is not State.FINISHED:  # the client went away
                self.abort(r, "The client disconnected.")

    def on_task_done(self, task: asyncio.Task[None]) -> None:
        """A bug in the simulator kills it the way an exception kills SGLang's scheduler."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        detail = "".join(traceback.format_exception(exc))
        self.sink("error", f"Scheduler hit an exception: {detail.rstrip()}")
        self.sink("error", logs.SIGQUIT_LINE)
        if self.dead is not None and not self.dead.done():
            self.dead.set_result(1)

    def gen_throughput_stale(self) -> bool:
        return self.now() - self.engine.last_decode_log_time > GEN_THROUGHPUT_STALENESS_S
