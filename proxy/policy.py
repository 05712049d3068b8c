"""The deployment policy: one TOML file that says how the proxy listens, queues, runs and paces.

    policy = load_policy("policies/default.toml")      # raises PolicyError naming the bad key
    policy.engine.kind, policy.pacing.queue_band, policy.describe()

Every table is optional and every key has a default, so ``parse_policy({}, "<empty>")`` is a valid
policy (one simulated worker). Unknown keys are errors. Each key is declared once, as a settings
field with its default, meaning and bounds in its metadata (:func:`proxy.policy_schema.key`): the
reader of the plain keys, :meth:`Policy.changed` and :func:`documented_defaults`
(``pacer check-policy --defaults``) are derived from those declarations. Engine args are checked against the
engine's own flag table (``proxy.engines.<engine>.argv.check_arg``) so a typo fails here, not
minutes later when a GPU worker refuses to start. The tables' settings are declared in
:mod:`proxy.policy_settings` and read in :mod:`proxy.policy_read`; this module puts them together
as :class:`Policy`, describes it, and re-exports the settings for callers.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from proxy.engines.registry import EngineKind
from proxy.policy_read import (
    bounds_known,
    ports_apart,
    read_admission,
    read_auth,
    read_batch,
    read_control,
    read_engine,
    read_fleet,
    read_pacing,
    read_pools,
    read_proxy,
    read_queue,
    read_store,
    store_url_problem,
)
from proxy.policy_reshape import reshape_allowed
from proxy.policy_schema import PolicyError, Table, changed_keys
from proxy.policy_settings import (
    TABLES,
    AdmissionSettings,
    AuthSettings,
    BatchSettings,
    ControlMode,
    ControlSettings,
    EngineSettings,
    FleetSettings,
    KeySettings,
    PacingSettings,
    PoolKeys,
    PoolSettings,
    Priority,
    ProxySettings,
    QueueSettings,
    StoreSettings,
    WorkerBackend,
    documented_defaults,
)

__all__ = [
    "TABLES",
    "AdmissionSettings",
    "AuthSettings",
    "BatchSettings",
    "ControlMode",
    "ControlSettings",
    "EngineKind",
    "EngineSettings",
    "FleetSettings",
    "KeySettings",
    "PacingSettings",
    "Policy",
    "PolicyError",
    "PoolKeys",
    "PoolSettings",
    "Priority",
    "ProxySettings",
    "QueueSettings",
    "StoreSettings",
    "WorkerBackend",
    "documented_defaults",
    "load_policy",
    "parse_policy",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    proxy: ProxySettings = ProxySettings()
    auth: AuthSettings = AuthSettings()
    queue: QueueSettings = QueueSettings()
    engine: EngineSettings = EngineSettings()
    pacing: PacingSettings = PacingSettings()
    control: ControlSettings = ControlSettings()
    batch: BatchSettings = BatchSettings()
    store: StoreSettings = StoreSettings()
    fleet: FleetSettings = FleetSettings()
    pools: tuple[PoolSettings, ...] = (PoolSettings(),)  # [[pool]] tables, or the [engine] table as one
    admission: AdmissionSettings = AdmissionSettings()
    source: str = "<defaults>"  # the file it came from

    def placement(self, visible: int | None) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each pool's GPU ids per worker, given how many GPUs NVML sees (None: it sees none).
        PolicyError naming the key when a pool asks for GPUs that are not there; a simulated pool's
        named GPUs are modelled ones, so it may name more than the host has."""
        explicit = frozenset(g for p in self.pools for g in p.given_gpus)
        taken = set(explicit)
        out: dict[str, tuple[tuple[int, ...], ...]] = {}
        for p in self.pools:
            if visible and p.engine.engine.uses_host_gpus:
                past = [g for g in p.given_gpus if g >= visible]
                if past:
                    raise PolicyError(
                        f"pool.{p.name}.gpus",
                        f"GPU {past[0]} does not exist: NVML sees {visible} (ids 0..{visible - 1})",
                        source=self.source,
                    )
            sets = p.gpu_sets(visible, frozenset(taken))
            taken.update(g for ids in sets for g in ids)
            out[p.name] = sets
        return out

    def describe(self) -> str:
        """A few lines for ``pacer check-policy`` and the start-up log."""
        return "\n".join(_describe(self))

    def changed(self) -> list[str]:
        """``table.key = value`` for every key not at its default (``pacer check-policy``); secrets
        masked. The lines are TOML that rebuilds the policy: with pools, the top-level keys first,
        then one ``[[pool]]`` table per pool with its own keys and its ``control.key`` /
        ``pacing.key`` overrides (where it differs from ``[control]`` / ``[pacing]``)."""
        pooled = not self.pools[0].shorthand
        tables = {name: getattr(self, name) for name in TABLES if not (pooled and name == "engine")}
        secret_args = {f"engine.args.{name}" for name in self.engine.engine.secret_args}
        lines = changed_keys(tables, secret=lambda key: ".env." in key or key in secret_args or key == "store.url")
        for pool in self.pools if pooled else ():
            pool_secrets = frozenset(f"args.{name}" for name in pool.engine.engine.secret_args)
            named = PoolKeys(name="")  # the name always shows; the other keys where not at their default
            lines += ["[[pool]]", *changed_keys({"": pool.keys}, secret=lambda _: False, baseline={"": named})]
            lines += changed_keys(
                {"": pool.engine, "control": pool.control, "pacing": pool.pacing},
                secret=functools.partial(_pool_secret, pool_secrets),
                baseline={"control": self.control, "pacing": self.pacing},
            )
        return lines


def _pool_secret(secret_args: frozenset[str], key: str) -> bool:
    """Whether a [[pool]] table's key holds a secret: its env values, the engine's secret args."""
    return key.startswith("env.") or key in secret_args


# --------------------------------------------------------------------------------------------------
# loading


def with_store_url_from_env(policy: Policy, environ: Mapping[str, str]) -> Policy:
    """The policy with ``store.url`` read from the variable ``store.url_env`` names (``pacer serve``,
    as it starts); PolicyError when that is unset or not a PostgreSQL URL."""
    name = policy.store.url_env
    if not name:
        return policy
    url = environ.get(name, "")
    if not url:
        raise PolicyError("store.url_env", f"${name} holds the store's url, but it is not set")
    if problem := store_url_problem(url):
        raise PolicyError("store.url_env", f"${name}: {problem}")
    return dataclasses.replace(policy, store=dataclasses.replace(policy.store, url=url))


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; relative auth files resolve against its folder."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise PolicyError("", "no such file", source=str(p)) from None
    except OSError as e:
        raise PolicyError("", f"cannot read: {e.strerror or e}", source=str(p)) from None
    except tomllib.TOMLDecodeError as e:
        raise PolicyError("", f"invalid TOML: {e}", source=str(p)) from None
    return parse_policy(data, str(p), base_dir=p.parent)


def parse_policy(mapping: Mapping[str, Any], source: str = "<policy>", *, base_dir: Path | None = None) -> Policy:
    """Validate an already-parsed TOML document. ``base_dir`` anchors relative auth files (default: cwd)."""
    root = Table(mapping, "", source)
    base = (base_dir or Path.cwd()).absolute()
    control_table = root.mapping("control")
    control = read_control(root.table("control"))
    pacing_table = root.mapping("pacing")
    pacing = read_pacing(root.table("pacing"))
    pool_tables = root.raw("pool", None)
    if pool_tables is None:
        engine = read_engine(root.table("engine"))
        pools: tuple[PoolSettings, ...] = (PoolSettings(engine=engine, control=control, pacing=pacing),)
    else:
        if root.has("engine"):
            raise root.error("engine", "use either [engine] (one pool) or [[pool]] tables, not both")
        pools = read_pools(root, pool_tables, control_table, pacing_table, source)
        engine = pools[0].engine
    policy = Policy(
        proxy=read_proxy(root.table("proxy")),
        auth=read_auth(root.table("auth"), base),
        queue=read_queue(root.table("queue")),
        engine=engine,
        pacing=pacing,
        control=control,
        batch=read_batch(root.table("batch")),
        store=read_store(root.table("store")),
        fleet=read_fleet(root.table("fleet")),
        pools=pools,
        admission=read_admission(root.table("admission")),
        source=source,
    )
    root.finish()
    for p in policy.pools:
        bounds_known(p, source)
        reshape_allowed(p, policy.fleet.backend, source)
    if policy.fleet.backend is WorkerBackend.LOCAL:
        ports_apart(policy.pools, source)
    if policy.fleet.backend is WorkerBackend.RAY:
        for p in policy.pools:
            if p.given_gpus:
                raise PolicyError(
                    f"pool.{p.name}.gpus",
                    'on Ray (fleet.backend = "ray") its GPU accounting picks each worker\'s GPUs: use gpus = "auto"',
                    source=source,
                )
    return policy


# --------------------------------------------------------------------------------------------------
# describe


def _describe(p: Policy) -> list[str]:
    q, pc, a = p.queue, p.pacing, p.auth
    lines = [f"policy {p.source}"]
    lines.append(
        f"  proxy    listen {p.proxy.host}:{p.proxy.port}, body <= {p.proxy.max_body_bytes} bytes, "
        f"upstream timeout {p.proxy.request_timeout_s:g} s, shutdown grace {p.proxy.shutdown_grace_s:g} s"
    )
    if a.configured:
        sources = [
            f"env {a.api_keys_env}" if a.api_keys_env else "",
            f"file {a.api_keys_file}" if a.api_keys_file else "",
        ]
        lines.append(f"  auth     API keys from {' and '.join(s for s in sources if s)}")
    else:
        lines.append("  auth     open (no API keys configured)")
    if a.admin_key_env or a.admin_key_file:
        lines.append(
            f"           admin key from {(a.admin_key_env and 'env ' + a.admin_key_env) or 'file ' + str(a.admin_key_file)}"
        )
    lines.append(
        f"  queue    capacity {q.capacity}, wait <= {q.timeout_s:g} s, default priority {q.default_priority}"
        f" (header {q.priority_header})"
    )
    for pool in p.pools:
        lines += _describe_pool(pool, several=len(p.pools) > 1 or not pool.shorthand)
    lines.append(
        f"  pacing   queue band [{pc.queue_band[0]}, {pc.queue_band[1]}], headroom {pc.headroom}, "
        f"scrape every {pc.scrape_interval_s:g} s (stale after {pc.stale_after_s:g} s), {pc.max_attempts} attempts; "
        "chat protected beside a batch for 5 engine seconds after the last (from each worker's limit)"
    )
    c = p.control
    lines.append(
        f"  control  {c.mode}: <= {c.restarts_per_hour} restarts/h per worker"
        + "".join(f", {arg} {_range_text(r)}" for arg, r in sorted(c.bounds.items()))
    )
    lines.append(f"  batch    /v1/batches kept in {p.batch.dir}, {p.batch.concurrency} lines in flight at most")
    if p.store.url_env and not p.store.url:
        lines.append(f"  store    PostgreSQL at the url in ${p.store.url_env}, shared by the replicas")
    if p.store.url:
        where = urlparse(p.store.url)
        lines.append(
            f"  store    PostgreSQL at {where.hostname or 'its socket'}{f':{where.port}' if where.port else ''}"
            f"{where.path}, shared by the replicas"
        )
    if p.fleet.backend is WorkerBackend.RAY:
        lines.append(f"  fleet    workers on Ray at {p.fleet.ray_address} (namespace {p.fleet.ray_namespace})")
    return lines


def _describe_pool(pool: PoolSettings, *, several: bool) -> list[str]:
    e, k = pool.engine, pool.keys
    lines = []
    if several:
        gpus = '"auto"' if pool.auto_gpus else (" ".join(map(str, pool.given_gpus)) or "not placed")
        control = f", control {pool.control.mode}" if pool.control.mode is not ControlMode.OFF else ""
        lines.append(f"  pool     {k.name}: model {k.model or '(as its workers say)'}, tp {k.tp}, GPUs {gpus}{control}")
        for i, ids in enumerate(pool.gpu_sets() if not pool.auto_gpus else ()):
            if ids:
                lines.append(f"           {pool.worker_id(i)} on GPU {','.join(map(str, ids))}")
    if e.managed:
        ports = "free ports" if e.base_port == 0 else f"ports {e.base_port}..{e.base_port + e.workers - 1}"
        lines.append(f"  engine   {e.kind} x{e.workers} on {e.host} ({ports}), logs in {e.log_dir}")
        if e.command:
            lines.append(f"           command {' '.join(e.command)}")
        secret = e.engine.secret_args
        shown = " ".join(f"{k}={'***' if k in secret else v}" for k, v in sorted(e.args.items()))
        lines.append(f"           args {shown or '(engine defaults)'}")
        for i, own in enumerate(e.worker_args):
            if own:
                mine = " ".join(f"{k}={'***' if k in secret else v}" for k, v in sorted(own.items()))
                lines.append(f"           worker {i} args {mine} (over args)")
        if e.extra_args:
            lines.append(f"           extra {' '.join(e.extra_args)}")
    else:
        lines.append(f"  engine   external ({e.speaks}): {', '.join(e.urls)}")
    return lines


def _range_text(bounds: Sequence[float]) -> str:
    """A ``bounds`` entry as check-policy prints it: ``in [low, high]``, or ``>= low`` for ``[low]``."""
    return f">= {bounds[0]:g}" if len(bounds) == 1 else f"in [{', '.join(f'{v:g}' for v in bounds)}]"
