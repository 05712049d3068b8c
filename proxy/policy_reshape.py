"""``reshape = true`` (a [[pool]]'s control): where the controller may change the pool's shape.

A reshape moves a pool's GPUs between shapes (workers x tp: one tp-8 worker, two tp-4, ...) on this
host, by restarting its workers; :func:`reshape_allowed` refuses the key, naming it, where that cannot
be done: the ``[engine]`` table (no GPUs placed), an external pool, Ray (its accounting places the
workers), fixed ports (the number of workers changes), an engine the twin does not model, one GPU.
"""

from __future__ import annotations

from proxy.engines.base import KnobName
from proxy.policy_schema import PolicyError
from proxy.policy_settings import PoolSettings, WorkerBackend

__all__ = ["reshape_allowed"]


def _why_not(pool: PoolSettings, backend: WorkerBackend) -> str | None:
    engine = pool.engine
    if pool.shorthand:
        return "needs a [[pool]] table with its tp and GPUs (the [engine] table places none)"
    if not engine.managed:
        return "the pool's workers are external: the proxy cannot restart them"
    if backend is WorkerBackend.RAY:
        return 'needs fleet.backend = "local": on Ray the cluster places each worker'
    if not pool.given_gpus and not pool.auto_gpus:
        return 'needs the pool\'s gpus (ids, or "auto"): a reshape places its workers on them'
    if engine.worker_args:
        return "worker_args name workers a reshape replaces: give the pool's args only"
    if engine.base_port:
        return "a reshape changes the number of workers: leave base_port out (ports chosen free)"
    if KnobName.CONSERVATIVENESS not in engine.engine.knobs:
        return f"the twin does not model {engine.engine.name}'s workers"
    if engine.workers * pool.tp < 2:
        return "one GPU has one shape"
    return None


def reshape_allowed(pool: PoolSettings, backend: WorkerBackend, source: str) -> None:
    """PolicyError where the pool asks for ``reshape = true`` and cannot be reshaped."""
    if not pool.control.reshape:
        return
    why = _why_not(pool, backend)
    if why is not None:
        where = "control" if pool.shorthand else f"pool.{pool.name}.control"
        raise PolicyError(f"{where}.reshape", why, source=source)
