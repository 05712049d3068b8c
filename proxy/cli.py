"""The ``pacer`` command: one entry point, one subcommand per job.

pacer sim [SGLang flags] [--sim-* flags]   the simulated SGLang engine
pacer serve --policy FILE [--port N]       the proxy (front door, pacing, control)
pacer check-policy FILE                    validate a policy file without starting anything
pacer check-policy --defaults              every policy key with its default and meaning
pacer status [--url U] [--watch]           a running proxy's workers, queues, args, last decisions
pacer decisions [--url U] [--rule R] ...   its controller's journal (filters, --json)
pacer try --worker W --args K=V [...]      try arguments on one worker as a canary (judged, kept or reverted)
pacer demo [--url U] [--start POLICY]      a workload that makes the controller act, with progress
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from proxy.policy import (
    Policy,
    PolicyError,
    WorkerBackend,
    documented_defaults,
    load_policy,
    with_store_url_from_env,
)
from proxy.server.auth import AuthConfigError, load_keyring, unkeyed

# subcommand -> "module:function"; each function takes the remaining argv and returns an exit code.
SUBCOMMANDS: dict[str, str] = {
    "sim": "proxy.sim.cli:main",
    "serve": "proxy.cli:serve_main",
    "check-policy": "proxy.cli:check_policy_main",
    "status": "proxy.console.status:main",
    "decisions": "proxy.console.decisions:main",
    "try": "proxy.console.trial:main",
    "demo": "proxy.console.demo:main",
}


if TYPE_CHECKING:
    from aiohttp import web

    from proxy.workers.process import Launcher

_log = logging.getLogger("proxy")


class LogFormat(logging.Formatter):
    """``[time] message``, as SGLang's own lines read; a warning or an error says so after the time
    (``[time] WARNING ...``, ``[time] ERROR ...``), so an operator can grep for them."""

    def __init__(self) -> None:
        super().__init__("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        if record.levelno < logging.WARNING:
            return text
        stamp = f"[{record.asctime}] "
        return f"{stamp}{record.levelname} {text.removeprefix(stamp)}"


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormat())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def _serve(policy: Policy, host: str, port: int) -> int:
    from proxy.compose import build_app
    from proxy.workers.fleet import build_pool

    try:
        gpus = _check_placement(policy, final=True)
    except PolicyError as exc:
        _log.error("%s", exc)
        return 2
    async with _launcher(policy) as launcher:
        if not policy.store.url:
            return await _serve_with(policy, build_app(policy, build_pool(policy, gpus, launcher)), host, port)
        from proxy.workers.replicas import ReplicaPool  # several replicas share the workers: one leads them

        replicas = ReplicaPool(
            lambda fence: build_pool(policy, gpus, launcher, fence=fence),
            url=policy.store.url,
            data_dir=policy.batch.dir,
        )
        return await _serve_with(policy, build_app(policy, replicas), host, port)


@contextlib.asynccontextmanager
async def _launcher(policy: Policy) -> AsyncIterator[Launcher | None]:
    """Where the workers run: this host (None), or the Ray cluster the policy names (attached for the
    proxy's lifetime)."""
    if policy.fleet.backend is not WorkerBackend.RAY:
        yield None
        return
    from proxy.workers.ray_backend import RayLauncher

    f = policy.fleet
    async with RayLauncher(f.ray_address, f.ray_namespace, poll_s=f.node_loss_check_s) as launcher:
        yield launcher


async def _serve_with(policy: Policy, app: web.Application, host: str, port: int) -> int:
    """Serve until SIGTERM or SIGINT, then stop: the drain (at most ``proxy.shutdown_grace_s``; a
    second signal ends it at once), then the workers. 1 when the address cannot be bound (nothing
    started)."""
    from proxy.compose import CannotListen, serving, stop_now

    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            _log.info("%s received", sig.name)
            stop.set()
        elif stop_now(app):
            _log.warning("%s, a second signal: stopping now", sig.name)
        else:
            _log.warning("%s, a second signal: the requests have ended already; the workers are stopping", sig.name)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    async with contextlib.AsyncExitStack() as stack:
        try:
            bound = await stack.enter_async_context(serving(app, host, port))
        except CannotListen as exc:
            _log.error("%s", exc)
            return 1
        # Everything built so far (modules, app, session) lives as long as the process: keep it out of
        # the collector's full passes, which otherwise scan it all and pause the event loop for tens of ms.
        gc.collect()
        gc.freeze()
        _log.info("sglang-pacer listening on http://%s:%d (OpenAI base URL http://%s:%d/v1)", host, bound, host, bound)
        await stop.wait()
    _log.info("stopped")
    return 0


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer serve", description="Run the proxy in front of the policy's workers.")
    parser.add_argument("--policy", required=True, help="policy TOML file")
    parser.add_argument("--host", help="listen address (default: the policy's proxy.host)")
    parser.add_argument("--port", type=int, help="listen port (default: the policy's proxy.port; 0 = any free)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        policy = with_store_url_from_env(load_policy(args.policy), os.environ)
        load_keyring(policy.auth)
    except (PolicyError, AuthConfigError) as exc:
        print(f"pacer serve: {exc}", file=sys.stderr)
        return 2
    host = args.host or policy.proxy.host
    port = policy.proxy.port if args.port is None else args.port
    # the command line's address is the one the proxy serves on: the summary says that one
    policy = dataclasses.replace(policy, proxy=dataclasses.replace(policy.proxy, host=host, port=port))
    for line in policy.describe().splitlines():
        _log.info("%s", line)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(_serve(policy, host, port))
    return uvloop.run(_serve(policy, host, port))


def _check_placement(policy: Policy, *, final: bool) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each pool's GPUs, checked against the GPUs NVML sees (when it sees any). ``final``: "auto"
    must resolve now (serve); otherwise it is shown as resolved at start (check-policy). On Ray,
    Ray's accounting places them (nothing to resolve here)."""
    if policy.fleet.backend is WorkerBackend.RAY:  # its accounting reserves tp GPUs a worker, on the node it picks
        return {}
    if not any(p.auto_gpus or p.given_gpus for p in policy.pools):
        return policy.placement(None)
    from proxy.observe.nvml import sample_gpus

    report = sample_gpus()
    visible = len(report.devices) if report.available else None
    if visible is None and not final and any(p.auto_gpus for p in policy.pools):
        print(f'  gpus     "auto" resolves at start ({report.reason})')
        return {}
    if visible is None and not final and any(p.given_gpus and p.engine.engine.uses_host_gpus for p in policy.pools):
        print(f"  gpus     the ids given are not checked against the host's GPUs ({report.reason})")
    return policy.placement(visible)


def check_policy_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer check-policy", description="Validate a policy file.")
    parser.add_argument("policy", nargs="?", help="policy TOML file")
    parser.add_argument("--defaults", action="store_true", help="print every key with its default and meaning, as TOML")
    args = parser.parse_args(argv)
    if args.defaults:
        print(documented_defaults(), end="")
        return 0
    if args.policy is None:
        parser.error("a policy file is required (or --defaults)")
    try:
        policy = load_policy(args.policy)
        keys = load_keyring(policy.auth, refuse_unkeyed=False)  # the keys may be given where it is served
    except (PolicyError, AuthConfigError) as exc:
        print(f"pacer check-policy: {exc}", file=sys.stderr)
        return 2
    print(policy.describe())
    if problem := unkeyed(policy.auth, keys):
        print(f"  warning  here {problem}: pacer serve refuses to start so")
    try:
        _check_placement(policy, final=False)
    except PolicyError as exc:
        print(f"pacer check-policy: {exc}", file=sys.stderr)
        return 2
    changed = policy.changed()
    print("  set      " + ("\n           ".join(changed) if changed else "(every key at its default)"))
    print(f"ok: {args.policy}" + (" (runs open: no API keys configured)" if keys.open and not problem else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    target = SUBCOMMANDS.get(name)
    if target is None:
        print(f"pacer: unknown command {name!r}; expected one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except BrokenPipeError:  # `pacer decisions | head` closed the pipe: what it wanted was printed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
