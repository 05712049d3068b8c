"""The dashboard's routes.

``GET /dashboard`` is the page; ``/dashboard/static/...`` its script, style and the charting
library (uPlot, MIT, vendored under ``static/vendor`` with its licence). The page holds no data and
no secret, so it is served to anyone; its data comes from ``GET /admin/timeline``, which needs the
admin key when one is set (the page asks for it and sends it as ``Authorization: Bearer``).

``GET /admin/timeline[?window_s=600]``::

    {"now": epoch s, "mode": "auto", "band": [lo, hi], "headroom": n,
     "workers": [{"id", "pool", "url", "state", "managed", "restarts", "args",
                  "series": {"t": [...], "queue": [...], "running": [...], "token_usage": [...],
                             "gen_throughput": [...], "retractions_per_min": [...], "in_flight": [...]}}],
     "proxy": {"t": [...], "queue_interactive": [...], "queue_batch": [...], "in_flight": [...]},
     "decisions": [journal entries, newest last, with "t": epoch s]}

``pool`` is the worker's pool name where the pool has one (None otherwise).
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.dashboard.history import History
from proxy.errors import ApiError
from proxy.server.auth import check_admin_key
from proxy.server.state import PROXY

__all__ = ["HISTORY", "STATIC_DIR", "add_routes"]

HISTORY = web.AppKey("dashboard_history", History)
STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_WINDOW_S = 600.0
MAX_DECISIONS = 200


def add_routes(app: web.Application) -> None:
    app.router.add_get("/dashboard", _page)
    app.router.add_get("/dashboard/", _page)
    app.router.add_static("/dashboard/static", STATIC_DIR, append_version=False)
    app.router.add_get("/admin/timeline", _timeline)


async def _page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def _epoch(iso: object) -> float | None:
    if not isinstance(iso, str):
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


async def _timeline(request: web.Request) -> web.Response:
    st = request.app[PROXY]
    check_admin_key(st.keys, request.headers)
    text = request.query.get("window_s")
    window_s = DEFAULT_WINDOW_S
    if text is not None:
        try:
            window_s = float(text)
        except ValueError:
            window_s = -1.0
        if not 0 < window_s < math.inf:
            raise ApiError(400, f"window_s must be a positive number of seconds, got {text!r}", param="window_s")
    history = request.app[HISTORY]
    now = history.now()
    since = now - window_s
    workers: list[dict[str, Any]] = []
    for info in st.pool.workers():
        workers.append(
            {
                "id": info.id,
                "pool": info.pool,
                "model": info.model,
                "url": info.url,
                "state": info.state.value,
                "managed": info.managed,
                "restarts": info.restarts,
                "args": dict(info.args),
                "series": history.worker_series(info.id, since),
            }
        )
    decisions = []
    if st.journal is not None:
        for entry in st.journal.entries(limit=MAX_DECISIONS):
            entry["t"] = _epoch(entry.get("time"))
            decisions.append(entry)
    lo, hi = st.policy.pacing.queue_band
    body = {
        "now": now,
        "window_s": window_s,
        "mode": st.control_mode(),
        "band": [lo, hi],
        "headroom": st.policy.pacing.headroom,
        "workers": workers,
        "proxy": history.proxy_series(since),
        "decisions": decisions,
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")
