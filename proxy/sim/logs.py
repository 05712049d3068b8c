"""SGLang 0.5.23's log lines, word for word, and the stderr sink that stamps them.

Every line is ``[%Y-%m-%d %H:%M:%S] message`` (TP size 1: no rank prefix; with tensor parallelism
SGLang's scheduler adds its rank, ``[%Y-%m-%d %H:%M:%S TP0] message``: the simulator speaks as rank
0), written to stderr and flushed at once so a supervisor tailing the stream sees it immediately.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def prefill_line(
    *,
    new_seq: int,
    new_token: int,
    cached_token: int,
    token_usage: float,
    running: int,
    queue: int,
    pending_token: int,
    cuda_graph: bool,
    input_throughput: float,
) -> str:
    return (
        f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached_token}, "
        f"token usage: {token_usage:.2f}, #running-req: {running}, #queue-req: {queue}, "
        f"#pending-token: {pending_token}, cuda graph: {cuda_graph}, "
        f"input throughput (token/s): {input_throughput:.2f}"
    )


def decode_line(
    *, running: int, used_tokens: int, token_usage: float, cuda_graph: bool, gen_throughput: float, queue: int
) -> str:
    return (
        f"Decode batch, #running-req: {running}, #token: {used_tokens}, token usage: {token_usage:.2f}, "
        f"cuda graph: {cuda_graph}, gen throughput (token/s): {gen_throughput:.2f}, #queue-req: {queue}"
    )


def retract_line(retracted: int, tokens_gained: int, old_ratio: float, new_ratio: float) -> str:
    return (
        f"KV cache pool is full. Retract requests. #retracted_reqs: {retracted}, "
        f"#new_tokens_gained: {tokens_gained}, #new_token_ratio: {old_ratio:.4f} -> {new_ratio:.4f}"
    )


def startup_line(
    *,
    max_total_num_tokens: int,
    chunked_prefill_size: int,
    max_prefill_tokens: int,
    max_running_requests: int,
    context_len: int,
    available_gpu_mem_gb: float,
) -> str:
    return (
        f"max_total_num_tokens={max_total_num_tokens}, chunked_prefill_size={chunked_prefill_size}, "
        f"max_prefill_tokens={max_prefill_tokens}, max_running_requests={max_running_requests}, "
        f"context_len={context_len}, available_gpu_mem={available_gpu_mem_gb:.2f} GB"
    )


READY_LINE = "The server is fired up and ready to roll!"

_MODEL_RUNNER = "/usr/local/lib/python3.12/dist-packages/sglang/srt"


def cuda_oom_traceback(*, phase: str, need_mib: float, total_mib: float, free_mib: float, used_mib: float) -> str:
    """``Scheduler hit an exception:`` with the CUDA out-of-memory traceback of a prefill or a decode."""
    frames = [
        ("managers/scheduler.py", 1112, "event_loop_normal", "result = self.run_batch(batch)"),
        (
            "managers/scheduler.py",
            2470,
            "run_batch",
            "batch_result = self.model_worker.forward_batch_generation(batch)",
        ),
        (
            "managers/tp_worker.py",
            402,
            "forward_batch_generation",
            "logits_output = self.model_runner.forward(forward_batch)",
        ),
        (
            ("model_executor/model_runner.py", 2291, "forward_extend", "return self.model.forward(")
            if phase == "prefill"
            else ("model_executor/model_runner.py", 2248, "forward_decode", "return self.model.forward(")
        ),
    ]
    lines = ["Scheduler hit an exception: Traceback (most recent call last):"]
    for path, lineno, func, code in frames:
        lines.append(f'  File "{_MODEL_RUNNER}/{path}", line {lineno}, in {func}')
        lines.append(f"    {code}")
    lines.append(
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {need_mib / 1024:.2f} GiB. "
        f"GPU 0 has a total capacity of {total_mib / 1024:.2f} GiB of which {max(free_mib, 0) / 1024:.2f} GiB is free. "
        f"Of the allocated memory {used_mib / 1024:.2f} GiB is allocated by PyTorch, and 0 bytes is reserved by "
        f"PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    return "\n".join(lines)


SIGQUIT_LINE = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."


class LogSink:
    """Writes SGLang-format lines to a stream (stderr by default), one flush per line."""

    def __init__(
        self, stream: TextIO | None = None, clock: Callable[[], float] = time.time, *, rank_prefix: str = ""
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.rank_prefix = rank_prefix  # " TP0" with tensor parallelism, as SGLang's scheduler writes it
        self._last_sec = -1
        self._stamp = ""

    def __call__(self, level: str, message: str) -> None:
        now = int(self.clock())
        if now != self._last_sec:
            self._last_sec = now
            self._stamp = time.strftime("[%Y-%m-%d %H:%M:%S", time.localtime(now)) + self.rank_prefix + "] "
        try:
            self.stream.write(self._stamp + message + "\n")
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def plain(self, message: str) -> None:
        """A line without SGLang's prefix (uvicorn's own lines)."""
        try:
            self.stream.write(message + "\n")
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass
