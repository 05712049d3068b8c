"""An asyncio load generator for OpenAI-compatible streaming endpoints.

Two shapes:

- :func:`open_loop`: requests leave on a fixed schedule (``rate`` per second for ``duration_s``),
  whatever happened to the earlier ones, so a slow server cannot slow the arrivals down. Each
  request is timed from the moment it is sent to its first content chunk (TTFT) and to its end.
- :func:`closed_loop`: ``concurrency`` clients, each sending its next request when the last one
  ended, for streaming-heavy phases; chunks are counted as they arrive so a window can be read off
  the running :class:`Counter` while the clients run.

A "chunk" is one server-sent event other than ``data: [DONE]``. Output tokens come from the
``usage`` event (``stream_options.include_usage``). Only the events before the first content and
the usage event are parsed as JSON, so the client stays cheap.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed ``/v1/completions`` body whose answer is exactly ``max_tokens`` tokens long
    (``ignore_eos``, which SGLang and its router accept)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }


@dataclass
class Counter:
    chunks: int = 0
    tokens: int = 0
    reads: int = 0  # socket reads that brought data: chunks / reads shows how much arrived coalesced


@dataclass
class Outcome:
    """One request: all times in seconds on the ``perf_counter`` clock."""

    scheduled: float
    sent: float
    first: float | None = None
    end: float | None = None
    chunks: int = 0
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def _has_content(event: bytes) -> bool:
    try:
        doc = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return False
    return any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in doc.get("choices") or ())


async def stream_one(
    session: aiohttp.ClientSession, url: str, payload: bytes, out: Outcome, counter: Counter | None = None
) -> None:
    """Send one streamed request and fill ``out``; never raises (errors land in ``out.error``)."""
    try:
        async with session.post(url, data=payload, headers=_HEADERS) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            tail = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                if counter is not None:
                    counter.reads += 1
                events = (tail + data).split(b"\n\n")
                tail = events.pop()
                for ev in events:
                    if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                        continue
                    out.chunks += 1
                    if counter is not None:
                        counter.chunks += 1
                    if out.first is None and _has_content(ev):
                        out.first = now
                    elif b'"usage":{' in ev:
                        usage = orjson.loads(ev[6:]).get("usage") or {}
                        n = int(usage.get("completion_tokens") or 0)
                        out.tokens = n
                        if counter is not None:
                            counter.tokens += n
                    elif b'"error"' in ev and ev.startswith(b'data: {"error"'):
                        out.error = ev[6:206].decode(errors="replace")
            out.end = time.perf_counter()
            if out.first is None and out.error is None:
                out.error = "stream ended without content"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        out.error = f"{exc.__class__.__name__}: {exc}"


def _session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
    )


@dataclass
class RunResult:
    outcomes: list[Outcome]
    client_cpu_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


async def open_loop(
    url: str,
    body: dict[str, Any],
    *,
    rate: float,
    duration_s: float,
    timeout_s: float = 60.0,
    poisson: random.Random | None = None,
) -> RunResult:
    """``rate`` requests per second for ``duration_s``; waits for them all. The schedule is fixed
    (evenly spaced) unless ``poisson`` is given: then the gaps are exponential draws from it (a
    Poisson stream of the same mean rate and count, reproducible from the generator's seed)."""
    payload = orjson.dumps(body)
    n = max(1, round(rate * duration_s))
    offsets = list(itertools.accumulate(poisson.expovariate(rate) for _ in range(n))) if poisson else None
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    cpu0, w0 = time.process_time(), time.perf_counter()
    async with _session(timeout_s) as session:
        start = time.perf_counter() + 0.05
        for i in range(n):
            at = start + (offsets[i] if offsets else i / rate)
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            out = Outcome(scheduled=at, sent=time.perf_counter())
            outcomes.append(out)
            tasks.append(asyncio.create_task(stream_one(session, url, payload, out)))
        await asyncio.gather(*tasks)
    return RunResult(outcomes, time.process_time() - cpu0, time.perf_counter() - w0)


async def closed_loop(
    url: str, body: dict[str, Any], *, concurrency: int, stop: asyncio.Event, counter: Counter, timeout_s: float = 120.0
) -> RunResult:
    """``concurrency`` clients back to back until ``stop`` is set; in-flight requests are then cut."""
    payload = orjson.dumps(body)
    outcomes: list[Outcome] = []
    cpu0, w0 = time.process_time(), time.perf_counter()

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            now = time.perf_counter()
            out = Outcome(scheduled=now, sent=now)
            await stream_one(session, url, payload, out, counter)
            outcomes.append(out)
            if out.error is not None:
                await asyncio.sleep(0.05)  # a failing server is not hammered in a tight loop

    async with _session(timeout_s) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(concurrency)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return RunResult(outcomes, time.process_time() - cpu0, time.perf_counter() - w0)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summarize(res: RunResult) -> dict[str, Any]:
    """TTFT percentiles (ms), output tokens per second (first send to last end), errors, client health."""
    done = [o for o in res.outcomes if o.error is None and o.ttft is not None and o.end is not None]
    errors = [o.error for o in res.outcomes if o.error is not None]
    ttfts = [o.ttft * 1000 for o in done]  # type: ignore[operator]
    lags = [(o.sent - o.scheduled) * 1000 for o in res.outcomes]
    first = min((o.sent for o in res.outcomes), default=0.0)
    last = max((o.end for o in done), default=first)  # type: ignore[type-var]
    span = max(last - first, 1e-9)  # type: ignore[operator]
    tokens = sum(o.tokens for o in done)
    chunks = sum(o.chunks for o in done)
    return {
        "requests": len(res.outcomes),
        "ok": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_p50_ms": round(percentile(ttfts, 50), 3) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 99), 3) if ttfts else None,
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / span, 1),
        "chunks": chunks,
        "chunks_per_s": round(chunks / span, 1),
        "span_s": round(span, 3),
        "client_send_lag_p99_ms": round(percentile(lags, 99), 3) if lags else None,
        "client_send_lag_max_ms": round(max(lags), 3) if lags else None,
        "client_cpu_cores": round(res.client_cpu_s / max(res.wall_s, 1e-9), 3),
    }
