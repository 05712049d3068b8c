"""The operator's view: ``/dashboard`` (static files in this package, no build step) fed by
``GET /admin/timeline`` (JSON: recent series per worker, the proxy's queue per class, the
controller's decisions, each worker's args), from a bounded history the board's samples feed."""

from proxy.dashboard.history import History
from proxy.dashboard.routes import HISTORY, add_routes

__all__ = ["HISTORY", "History", "add_routes"]
