"""A throwaway engine worker for supervisor tests: a real process with a real HTTP port.

Takes the flags the supervisor passes (``--host``, ``--port``, ``--enable-metrics`` and any engine
flags, which it echoes on ``GET /args``) plus its own ``--fake-*`` flags:

    --fake-startup-seconds S   /health answers 503 for S seconds, then 200
    --fake-health-delay S      /health takes S seconds to answer
    --fake-exit-at-start CODE  print an error and exit with CODE before listening
    --fake-clash-once FILE     the first start (FILE absent) fails like a port clash, later ones run
    --fake-ignore-sigterm      ignore SIGTERM (the supervisor must SIGKILL)
    --fake-spawn-child         fork a child that sleeps (it must die with its group)
    --fake-info-port N         ``GET /server_info`` says it serves port N (another server's info)

``GET /server_info`` gives its port, its start (wall seconds) and its engine flags by name, as
SGLang's does. ``POST /crash`` prints a fatal line and exits with code 3. A "Decode batch" line is printed to
stderr every 0.1 s, a start-up line to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from aiohttp import web


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--fake-startup-seconds", type=float, default=0.0)
    p.add_argument("--fake-health-delay", type=float, default=0.0)
    p.add_argument("--fake-exit-at-start", type=int, default=None)
    p.add_argument("--fake-clash-once", default=None)
    p.add_argument("--fake-ignore-sigterm", action="store_true")
    p.add_argument("--fake-spawn-child", action="store_true")
    p.add_argument("--fake-info-port", type=int, default=None)
    return p.parse_known_args(argv)


def _number(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


async def main() -> None:
    opts, engine_flags = parse(sys.argv[1:])
    print(f"fake worker pid {os.getpid()} starting on port {opts.port}", flush=True)
    if opts.fake_exit_at_start is not None:
        print(
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(opts.fake_exit_at_start)
    if opts.fake_clash_once and not os.path.exists(opts.fake_clash_once):
        open(opts.fake_clash_once, "w").close()
        print(
            f"OSError: [Errno 98] error while attempting to bind on address ('{opts.host}', {opts.port}): address already in use",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    if opts.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = None
    if opts.fake_spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    ready_at = time.monotonic() + opts.fake_startup_seconds
    started = time.time()

    async def health(_: web.Request) -> web.Response:
        await asyncio.sleep(opts.fake_health_delay)
        return web.Response(status=200 if time.monotonic() >= ready_at else 503)

    async def args(_: web.Request) -> web.Response:
        body = {
            "argv": sys.argv[1:],
            "engine_flags": engine_flags,
            "pid": os.getpid(),
            "child_pid": child.pid if child else None,
        }
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def server_info(_: web.Request) -> web.Response:
        flags = dict(zip(engine_flags[::2], engine_flags[1::2], strict=False))
        body: dict[str, object] = {k.lstrip("-").replace("-", "_"): _number(v) for k, v in flags.items()}
        body.update(port=opts.fake_info_port or opts.port, startup_time=started)
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def crash(_: web.Request) -> web.Response:
        print("Fatal: crash requested", file=sys.stderr, flush=True)
        os._exit(3)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/args", args)
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/crash", crash)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, opts.host, opts.port).start()
    print(f"The server is fired up and ready to roll! port {opts.port}", file=sys.stderr, flush=True)
    step = 0
    while True:
        await asyncio.sleep(0.1)
        step += 1
        print(
            f"Decode batch, #running-req: 0, #token: 0, token usage: 0.00, #queue-req: {step}, ",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
