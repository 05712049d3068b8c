"""What the engine reports: its counters, the throughputs SGLang logs, and the log lines themselves.

The engine calls one hook per event (:meth:`StepReporter.on_prefill`, :meth:`~StepReporter.on_decode`,
:meth:`~StepReporter.on_retract`); the reporter keeps the counters the metrics endpoint exports
(read by the driver) and formats the scheduler's log lines (:mod:`proxy.sim.logs`). Nothing here
takes part in a decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.sim import logs
from proxy.sim.kv_pool import KvPool
from proxy.sim.prefill_adder import AdmitItem
from proxy.sim.request import Req

LogFn = Callable[[str, str], None]  # (level, message)


class StepReporter:
    __slots__ = (
        "_gen_tokens_since_log",
        "_input_log_tic",
        "_input_tokens_since_log",
        "_log",
        "decode_stats",
        "decode_steps",
        "gen_log_tic",
        "generated_tokens",
        "last_cache_hit_rate",
        "last_cuda_graph",
        "last_gen_throughput",
        "last_input_throughput",
        "last_retracted",
        "retracted_input_tokens",
        "retracted_output_tokens",
        "retracted_total",
    )

    def __init__(self, log: LogFn | None) -> None:
        self._log = log
        self.decode_steps = 0
        self.generated_tokens = 0  # every output token produced (prefill first tokens and decode steps)
        self.retracted_total = 0
        self.retracted_input_tokens = 0
        self.retracted_output_tokens = 0
        self.last_retracted = 0
        self.last_cache_hit_rate = 0.0
        self.last_gen_throughput = 0.0
        # (time, running, used tokens, gen throughput, cuda graph) of every decode statistics line, logged or not
        self.decode_stats: list[tuple[float, int, int, float, bool]] = []
        self.last_input_throughput = 0.0
        self.last_cuda_graph = False  # whether the last decode step planned ran in a CUDA graph
        self._gen_tokens_since_log = 0
        self.gen_log_tic = 0.0  # when the last decode line was logged
        self._input_tokens_since_log = 0
        self._input_log_tic = 0.0

    def message(self, level: str, msg: str) -> None:
        if self._log is not None:
            self._log(level, msg)

    def on_prefill(
        self, now: float, items: Sequence[AdmitItem], extend_total: int, kv: KvPool, queue: int, pending_tokens: int
    ) -> None:
        hit = sum(it.hit for it in items)
        self.last_cache_hit_rate = hit / (hit + extend_total) if hit + extend_total else 0.0
        self._input_tokens_since_log += extend_total
        elapsed = now - self._input_log_tic
        if elapsed > 0:
            self.last_input_throughput = self._input_tokens_since_log / elapsed
            self._input_tokens_since_log = 0
            self._input_log_tic = now
        if self._log is None:
            return
        self._log(
            "info",
            logs.prefill_line(
                new_seq=len(items),
                new_token=extend_total,
                cached_token=hit,
                token_usage=kv.usage,
                running=kv.running.n,
                queue=queue,
                pending_token=max(0, pending_tokens),
                cuda_graph=False,
                input_throughput=self.last_input_throughput,
            ),
        )

    def on_first_token(self) -> None:
        self.generated_tokens += 1

    def on_decode(self, decoded: int) -> None:
        self.decode_steps += 1
        self.generated_tokens += decoded
        self._gen_tokens_since_log += decoded

    def on_decode_log(self, now: float, cuda_graph: bool, kv: KvPool, queue: int) -> None:
        elapsed = now - self.gen_log_tic
        self.last_gen_throughput = self._gen_tokens_since_log / elapsed if elapsed > 0 else 0.0
        self._gen_tokens_since_log = 0
        self.gen_log_tic = now
        self.decode_stats.append((now, kv.running.n, kv.num_used, self.last_gen_throughput, cuda_graph))
        if self._log is None:
            return
        self._log(
            "info",
            logs.decode_line(
                running=kv.running.n,
                used_tokens=kv.num_used,
                token_usage=kv.usage,
                cuda_graph=cuda_graph,
                gen_throughput=self.last_gen_throughput,
                queue=queue,
            ),
        )

    def on_retracted(self, r: Req) -> None:
        self.retracted_input_tokens += r.prompt_len
        self.retracted_output_tokens += r.out_base

    def on_retract(self, count: int, gained: int, old_ratio: float, new_ratio: float) -> None:
        self.retracted_total += count
        self.last_retracted = count
        self.message("warning", logs.retract_line(count, gained, old_ratio, new_ratio))
