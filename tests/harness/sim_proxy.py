"""A whole proxy (``build_app`` on a free port) in front of real ``pacer sim`` worker processes the
supervisor starts; everything it started is stopped when the block ends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.compose import build_app, serve
from proxy.policy import parse_policy
from proxy.server.state import PROXY, ProxyState
from proxy.workers.supervisor import Supervisor

# fast simulated workers: 20x the modelled speed, a 0.2 s start-up
FAST_SIM = ["--sim-time-scale", "20", "--sim-startup-seconds", "0.2"]


@dataclass(frozen=True)
class SimProxy:
    url: str  # the proxy's, without /v1
    state: ProxyState
    pool: Supervisor


@contextlib.asynccontextmanager
async def serve_sims(tmp_path: Path, engine: dict[str, Any], **sections: Any) -> AsyncIterator[SimProxy]:
    """The proxy with ``[engine]`` of kind ``sim`` (``engine`` over the defaults: one worker at
    :data:`FAST_SIM`, its logs under ``tmp_path``) and the policy's other ``sections``; its batches
    under ``tmp_path``. The controller is off unless ``sections`` has a ``control`` table: these
    tests are about the request path, and a controller would revive, limit and restart under them."""
    policy = parse_policy(
        {
            "engine": {
                "kind": "sim",
                "extra_args": FAST_SIM,
                "log_dir": str(tmp_path / "logs"),
                "startup_timeout_s": 60,
                "stop_grace_s": 5,
                **engine,
            },
            "batch": {"dir": str(tmp_path / "batches")},
            "control": {"mode": "off"},
            **sections,
        },
        "<sim proxy>",
    )
    pool = Supervisor(policy.engine)
    app = build_app(policy, pool)
    runner, port = await serve(app, "127.0.0.1", 0)
    try:
        yield SimProxy(f"http://127.0.0.1:{port}", app[PROXY], pool)
    finally:
        await runner.cleanup()  # stops the workers too
