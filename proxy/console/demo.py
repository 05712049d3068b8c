"""``pacer demo``: a workload that gives the controller something to do, with a status line.

Two phases, each a closed loop of ``--concurrency`` completions in flight (more than the worker
admits, so a backlog waits):

1. ``early-stop``: ``max_tokens`` 4096, answers of 100-400 tokens. SGLang reserves room for what a
   request may still write, so token usage stays low. The output budget answers it without a
   restart, with the gain the planner's twin predicts for it and the one measured by holding it
   back a while (its pace with it over its pace held back, or why not); the planner journals its
   twin's view of the same load (its predicted gain).
2. ``shift``: answers run nearly to ``max_tokens``. Those past the budget are continued (one answer
   each) and the budget is lifted.

A phase ends ``--settle-s`` after the controller journals a decision that acts, once an output
budget's predicted and measured gain are in (its check), or after ``--phase-s``. The
true output length travels in the simulator's ``sim_output_len`` field.

With no proxy at ``--url``, ``--start POLICY`` starts one as a child process and stops it at the
end (Ctrl-C and SIGTERM included); without ``--start`` it says how to start one and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import aiohttp

from proxy.console.admin import DEFAULT_URL, KEY_ENV, URL_ENV
from proxy.console.decisions import gain_text

_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_ACTS = ("acting", "applied")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    what: str
    max_tokens: int
    output_len: tuple[int, int]
    prompt_len: tuple[int, int] = (200, 600)


PHASES = (
    Phase("early-stop", "max_tokens 4096, answers stop after 100-400 tokens", 4096, (100, 400)),
    Phase("shift", "answers now run to 3000-4096 tokens", 4096, (3000, 4096)),
)


@dataclass
class Progress:
    sent: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(_ALPHABET, k=4)) for _ in range(n))


class Demo:
    def __init__(self, session: aiohttp.ClientSession, url: str, admin_key: str | None, model: str) -> None:
        self.session = session
        self.url = url
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.model = model
        self.seen_ids: set[int] = set()

    async def admin(self, path: str) -> Any:
        async with self.session.get(self.url + path, headers=self.admin_headers) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def one(self, phase: Phase, rng: random.Random, progress: Progress) -> None:
        body = {
            "model": self.model,
            "prompt": _prompt(rng, rng.randint(*phase.prompt_len)),
            "max_tokens": phase.max_tokens,
            "sim_output_len": rng.randint(*phase.output_len),
        }
        progress.sent += 1
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    message = str(payload.get("error", {}).get("message", resp.reason))[:80]
                    raise RuntimeError(f"{resp.status} {message}")
            progress.done += 1
            progress.tokens += int(payload.get("usage", {}).get("completion_tokens", 0))
        except (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError) as exc:
            progress.failed += 1
            key = str(exc)[:60] or type(exc).__name__
            progress.errors[key] = progress.errors.get(key, 0) + 1

    async def run_phase(self, phase: Phase, concurrency: int, phase_s: float, settle_s: float, seed: int) -> bool:
        rng = random.Random(seed)
        progress = Progress()
        print(f"[demo] phase {phase.name}: {phase.what}; {concurrency} requests kept in flight", flush=True)
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await self.one(phase, rng, progress)

        tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
        start = time.monotonic()
        acted_at: float | None = None
        awaiting: set[int] = set()  # acted decisions whose predicted or measured gain is not in yet
        try:
            while True:
                await asyncio.sleep(1.0)
                now = time.monotonic()
                line, new, entries = await self.status_line(phase, progress, now - start)
                for entry in new:
                    print(f"\n[demo] decision #{entry['id']} {entry['worker']} {entry['rule']} "
                          f"[{entry['status']}]: {entry['reason']}", flush=True)  # fmt: skip
                    if entry["status"] in _ACTS:
                        acted_at = now if acted_at is None else acted_at
                        awaiting.update([entry["id"]] if _gains_pending(entry) else [])
                for entry in entries:
                    if entry["id"] in awaiting and not _gains_pending(entry):
                        awaiting.discard(entry["id"])
                        print(f"\n[demo] decision #{entry['id']}{gain_text(entry)}", flush=True)
                sys.stdout.write("\r" + line + "\x1b[K" if sys.stdout.isatty() else line + "\n")
                sys.stdout.flush()
                if acted_at is not None and now - acted_at >= settle_s and not awaiting:
                    break
                if now - start >= phase_s:
                    break
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - start
        print(f"\n[demo] phase {phase.name} ended after {elapsed:.0f} s: {progress.done} answered, "
              f"{progress.failed} failed" + ("" if acted_at else "; the controller did not act in it"), flush=True)  # fmt: skip
        for text, count in sorted(progress.errors.items(), key=lambda kv: -kv[1])[:3]:
            print(f"[demo]   {count} x {text}", flush=True)
        return acted_at is not None

    async def status_line(
        self, phase: Phase, progress: Progress, elapsed: float
    ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        """The status line, the decisions not seen before and the newest decisions."""
        rate = progress.done / elapsed if elapsed > 0 else 0.0
        text = (
            f"[demo] {phase.name} {elapsed:4.0f}s · sent {progress.sent} · done {progress.done} "
            f"({rate:.1f}/s, {progress.tokens / max(elapsed, 1e-9):.0f} tok/s) · failed {progress.failed}"
        )
        new: list[dict[str, Any]] = []
        try:
            workers = await self.admin("/admin/workers")
            decisions = await self.admin("/admin/decisions?limit=20")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return text + f" · admin: {exc}", new, []
        queue = sum(workers.get("proxy_queue", {}).values())
        text += f" · proxy queue {queue}"
        for w in workers.get("workers", []):
            s = w.get("sample") or {}
            budgets = {k: v for per_class in (w.get("output_budget") or {}).values() for k, v in per_class.items()}
            budget = ", ".join(f"{asked} -> {sent}" for asked, sent in budgets.items()) or "none"
            text += (
                f" · {w['id']} {w['state']} q {s.get('queue', '-')} run {s.get('running', '-')} "
                f"usage {s.get('token_usage', 0):.2f} budget {budget}"
            )
        for entry in decisions.get("decisions", []):
            if entry["id"] not in self.seen_ids:
                self.seen_ids.add(entry["id"])
                new.append(entry)
        return text, new, list(decisions.get("decisions", []))


def _gains_pending(entry: dict[str, Any]) -> bool:
    """An output budget set or moved whose predicted or measured gain is not in yet (nor why not)."""
    if entry.get("rule") != "output_budget" or (entry.get("evidence") or {}).get("budget_tokens") is None:
        return False
    predicted = "predicted_gain" in entry or "not_predicted" in entry
    return not (predicted and ("measured_gain" in entry or "not_measured" in entry))


async def _reachable(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status < 500
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


@contextlib.contextmanager
def _started_proxy(policy: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``pacer serve --policy POLICY --port 0`` as a child in its own process group."""
    cmd = [sys.executable, "-m", "proxy", "serve", "--policy", policy, "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _wait_listening(proc: subprocess.Popen[str], lines: list[str], timeout_s: float) -> str:
    """The URL the child logs once it listens (it picked a free port)."""
    assert proc.stderr is not None
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    pattern = re.compile(r"listening on (http://\S+?) ")
    while loop.time() < end:
        line = await asyncio.wait_for(loop.run_in_executor(None, proc.stderr.readline), end - loop.time())
        if not line:
            raise RuntimeError(f"the proxy exited ({proc.wait()}): " + "".join(lines[-5:]))
        lines.append(line)
        if m := pattern.search(line):

            def drain(stream: IO[str] = proc.stderr) -> None:  # keep reading its log so the pipe never fills
                for rest in iter(stream.readline, ""):
                    lines.append(rest)
                    del lines[:-50]

            loop.run_in_executor(None, drain)
            return m.group(1)
    raise TimeoutError(f"the proxy did not listen within {timeout_s:g} s")


async def _ready(url: str, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    async with aiohttp.ClientSession() as s:
        while loop.time() < end:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"no worker was ready within {timeout_s:g} s")


async def _model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as r:
        body = await r.json(content_type=None)
    data = body.get("data") or []
    return str(data[0]["id"]) if data else "default"


@contextlib.asynccontextmanager
async def _target(args: argparse.Namespace) -> AsyncIterator[str]:
    url = (args.url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    if await _reachable(url):
        yield url
        return
    if not args.start:
        print(f"pacer demo: no proxy answers at {url}; start one (make run) or pass --start POLICY", file=sys.stderr)
        raise SystemExit(1)
    print(f"[demo] no proxy at {url}: starting one with {args.start} (stopped at the end)", flush=True)
    with _started_proxy(args.start) as (proc, lines):
        url = await _wait_listening(proc, lines, 60)
        print(f"[demo] proxy listening on {url}; dashboard: {url}/dashboard", flush=True)
        yield url


async def _demo(args: argparse.Namespace) -> int:
    # SIGTERM ends the demo as Ctrl-C does: by cancelling it, so that a proxy it started is stopped
    # (that proxy and its workers run in sessions of their own: no signal to the demo reaches them)
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    async with _target(args) as url:
        await _ready(url, args.ready_timeout_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            demo = Demo(session, url, args.admin_key or os.environ.get(KEY_ENV), await _model(session, url))
            demo.seen_ids.update(e["id"] for e in (await demo.admin("/admin/decisions")).get("decisions", []))
            print(f"[demo] sending to {url} (watch {url}/dashboard, or `pacer status --watch --url {url}`)")
            acted = 0
            for i, phase in enumerate(PHASES[: args.phases]):
                acted += await demo.run_phase(phase, args.concurrency, args.phase_s, args.settle_s, seed=i)
            print(f"[demo] done: the controller acted in {acted} of {min(args.phases, len(PHASES))} phase(s); "
                  f"`pacer decisions --url {url}` lists its journal", flush=True)  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer demo", description="Send a workload that makes the controller act.")
    parser.add_argument("--url", default=None, help=f"the proxy (default: ${URL_ENV} or {DEFAULT_URL})")
    parser.add_argument("--admin-key", default=None, help=f"the admin key, to read decisions (default: ${KEY_ENV})")
    parser.add_argument("--start", metavar="POLICY", help="with no proxy at --url, start one with this policy")
    parser.add_argument("--concurrency", type=int, default=1000, help="requests kept in flight (default 1000)")
    parser.add_argument("--phase-s", type=float, default=120.0, help="longest time per phase (default 120)")
    parser.add_argument("--settle-s", type=float, default=15.0, help="time a phase runs on after the controller acts")
    parser.add_argument("--phases", type=int, default=len(PHASES), help="how many phases to run (default all)")
    parser.add_argument("--ready-timeout-s", type=float, default=120.0, help="wait this long for a ready worker")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(_demo(args))
    try:
        return uvloop.run(_demo(args))
    except KeyboardInterrupt:
        print("\n[demo] interrupted", file=sys.stderr)
        return 130
    except asyncio.CancelledError:  # SIGTERM
        print("\n[demo] terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
