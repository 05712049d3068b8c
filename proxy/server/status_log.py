"""A periodic status line in the spirit of SGLang's decode log line::

[pacer] #proxy-queue: 120 (interactive 0, batch 120), #in-flight: 64, w0: #queue-req: 14, #running-req: 18, token usage: 0.81, w1: ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from proxy.request.admission import ORDER
from proxy.request.pacing import LoadBoard
from proxy.request.queues import QueueDepth
from proxy.workers.base import WorkerInfo, WorkerPool, WorkerState

_log = logging.getLogger("proxy.status")


def format_status(
    admission: QueueDepth, board: LoadBoard, workers: Sequence[WorkerInfo], now: float, stale_after_s: float
) -> str:
    per_class = ", ".join(f"{p.value} {admission.depth(p)}" for p in ORDER)
    parts = [f"#proxy-queue: {len(admission)} ({per_class})", f"#in-flight: {board.total_in_flight()}"]
    for w in workers:
        load = board.get(w.id)
        s = load.sample
        text = f"{w.id}: {w.state.value}" if w.state is not WorkerState.READY else f"{w.id}:"
        text += f" #in-flight: {load.in_flight}"
        if s is not None:
            text += f", #queue-req: {s.queue}, #running-req: {s.running}, token usage: {s.token_usage:.2f}"
            if load.error:
                text += f" (last scrape failed: {load.error})"
            elif not load.fresh(now, stale_after_s):
                text += f" (stale {now - s.time:.1f} s)"
        elif load.error:
            text += f", no sample ({load.error})"
        parts.append(text)
    return "[pacer] " + ", ".join(parts)


async def run_status_log(
    admission: QueueDepth, board: LoadBoard, pool: WorkerPool, interval_s: float, stale_after_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        _log.info("%s", format_status(admission, board, pool.workers(), time.monotonic(), stale_after_s))
