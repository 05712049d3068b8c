"""Is the simulated engine the bottleneck? ``python -m loadtests sim [--report FILE.json]``

Two measurements:

1. **virtual**: :func:`proxy.sim.virtual.simulate` over the guide-like workload (prompts of 800
   tokens, 1,600 output tokens, the H100 + Llama-3.1-8B preset): simulated tokens per CPU second.
2. **server**: ``pacer sim`` at ``--sim-time-scale 1`` pinned to one CPU core, driven over HTTP by
   enough concurrent streaming clients to fill its batch. Over a window after warm-up it reports the
   modelled token rate (tokens the engine generated / modelled seconds of the steps it ran), the
   rate clients received (tokens / wall seconds), how far the steps ran behind their modelled
   durations (``lag``: wall / modelled step time; 1.0 = on time), the server's CPU use in cores and
   the share of time it waited for a core held by another process (``server_runqueue_wait_fraction``).
   The simulator keeps up when ``lag`` stays near 1 and the received rate matches the modelled one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.procs import cpu_seconds, runqueue_wait_seconds

ROOT = Path(__file__).resolve().parents[1]


def bench_virtual(requests: int, prompt_len: int, max_new: int) -> dict[str, Any]:
    from proxy.sim.cli import build_parser, resolve_config
    from proxy.sim.request import RequestSpec
    from proxy.sim.virtual import simulate

    cfg = resolve_config(build_parser().parse_args([]))
    wl = [RequestSpec(prompt_len=prompt_len, max_new_tokens=max_new) for _ in range(requests)]
    t0 = time.process_time()
    res = simulate(cfg, wl)
    cpu = time.process_time() - t0
    return {
        "requests": requests,
        "output_tokens": res.output_tokens,
        "steps": res.steps,
        "modelled_seconds": round(res.makespan_s, 2),
        "modelled_tok_per_s": round(res.output_tok_per_s, 1),
        "cpu_seconds": round(cpu, 3),
        "simulated_tok_per_cpu_s": round(res.output_tokens / cpu),
        "speedup_vs_real_time": round(res.makespan_s / cpu, 1),
    }


async def _server_state(session: Any, url: str) -> dict[str, Any]:
    async with session.get(url + "/server_info") as resp:
        info = await resp.json()
    sim: dict[str, Any] = info["internal_states"][0]["sim"]
    return sim


async def _client(session: Any, url: str, body: dict[str, Any], stop_at: float, counts: list[int]) -> None:
    while time.monotonic() < stop_at:
        async with session.post(url + "/generate", json=body) as resp:
            if body["stream"]:
                tail = b""
                async for data in resp.content.iter_any():  # count SSE events without parsing them
                    data = tail + data
                    counts[0] += data.count(b"\n\ndata: {") + (data.startswith(b"data: {") and not tail)
                    tail = data[-8:]
                    if time.monotonic() >= stop_at:
                        return
            else:
                out = await resp.json()
                counts[0] += out["meta_info"]["completion_tokens"]


async def _drive(
    url: str, pid: int, concurrency: int, warmup: float, window: float, body: dict[str, Any]
) -> dict[str, Any]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        counts = [0]
        stop_at = time.monotonic() + warmup + window + 2.0  # clients outlive the measurement window
        tasks = [asyncio.create_task(_client(session, url, body, stop_at, counts)) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        s0, c0, cpu0, t0 = await _server_state(session, url), counts[0], cpu_seconds(pid), time.monotonic()
        w0 = runqueue_wait_seconds(pid)
        await asyncio.sleep(window)
        s1, c1, cpu1, t1 = await _server_state(session, url), counts[0], cpu_seconds(pid), time.monotonic()
        w1 = runqueue_wait_seconds(pid)
        async with session.get(url + "/v1/loads") as resp:
            loads = (await resp.json())["loads"][0]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = t1 - t0
    modelled = s1["busy_modelled_s"] - s0["busy_modelled_s"]
    stepped_wall = s1["busy_wall_s"] - s0["busy_wall_s"]
    generated = s1["generated_tokens"] - s0["generated_tokens"]
    return {
        "window_s": round(wall, 2),
        "engine_tokens": generated,
        "client_tokens": c1 - c0,
        "modelled_tok_per_s": round(generated / modelled, 1) if modelled else 0.0,
        "engine_tok_per_wall_s": round(generated / wall, 1),
        "client_tok_per_wall_s": round((c1 - c0) / wall, 1),
        "lag": round(stepped_wall / modelled, 4) if modelled else None,
        "busy_fraction": round(stepped_wall / wall, 3),
        "server_cpu_cores": round((cpu1 - cpu0) / wall, 3),
        "server_runqueue_wait_fraction": round((w1 - w0) / wall, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "running_at_end": loads["num_running_reqs"],
        "token_usage_at_end": loads["token_usage"],
    }


def bench_server(args: argparse.Namespace) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    core = args.core if args.core is not None else cores[-1]
    cmd = [
        sys.executable,
        "-m",
        "proxy",
        "sim",
        "--port",
        "0",
        "--sim-startup-seconds",
        "0.5",
        "--sim-time-scale",
        str(args.time_scale),
        "--enable-metrics",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    try:
        port = None
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
            if m:
                port = int(m.group(1))
            if "ready to roll" in line:
                break
        if port is None:
            raise RuntimeError("pacer sim did not start")
        # drain the log so the pipe never blocks the server
        import threading

        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        if len(cores) > 1:
            os.sched_setaffinity(0, set(cores) - {core})
        body = {
            "text": "lorem ipsum " * (args.prompt_len // 3),
            "stream": args.mode == "stream",
            "sampling_params": {"max_new_tokens": args.max_new_tokens, "ignore_eos": True},
        }
        out = asyncio.run(
            _drive(f"http://127.0.0.1:{port}", proc.pid, args.concurrency, args.warmup, args.window, body)
        )
        out.update(mode=args.mode, concurrency=args.concurrency, time_scale=args.time_scale, server_core=core)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests sim", description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--mode", choices=("stream", "plain"), default="stream")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=800)
    p.add_argument("--max-new-tokens", type=int, default=1600)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--core", type=int, default=None, help="CPU core for the server (default: the last one)")
    p.add_argument("--skip-server", action="store_true")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"virtual": bench_virtual(1200, args.prompt_len, args.max_new_tokens)}
    print(json.dumps({"virtual": report["virtual"]}, indent=2), flush=True)
    if not args.skip_server:
        report["server"] = bench_server(args)
        print(json.dumps({"server": report["server"]}, indent=2), flush=True)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0
