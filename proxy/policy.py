"""The deployment policy: one TOML file that says how the proxy listens, queues, runs and paces.

    policy = load_policy("policies/default.toml")      # raises PolicyError naming the bad key
    policy.engine.kind, policy.pacing.queue_band, policy.describe()

Every table is optional and every key has a default, so ``parse_policy({}, "<empty>")`` is a valid
policy (one simulated worker). Unknown keys are errors. Each key is declared once, as a settings
field with its default, meaning and bounds in its metadata (:func:`proxy.policy_schema.key`): the
reader of the plain keys, :meth:`Policy.changed` and :func:`documented_defaults`
(``pacer check-policy --defaults``) are derived from those declarations. Engine args are checked against the
engine's own flag table (``proxy.engines.<engine>.argv.check_arg``) so a typo fails here, not
minutes later when a GPU worker refuses to start.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlparse

from proxy.engines.base import KnobName
from proxy.engines.contract import Engine
from proxy.engines.registry import ENGINES, SPOKEN_BY_DEFAULT, EngineKind, engine_named, example_arg
from proxy.policy_schema import PolicyError, Table, changed_keys, defaults_toml, key, read_settings

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
    "WorkerBackend",
    "documented_defaults",
    "load_policy",
    "parse_policy",
]


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


def _empty_table() -> Mapping[str, Any]:
    return MappingProxyType({})


class ControlMode(StrEnum):
    AUTO = "auto"  # the controller restarts workers with retuned args
    ADVISE = "advise"  # the controller logs what it would do
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxySettings:
    host: str = field(default="127.0.0.1", metadata=key("where clients connect"))
    port: int = field(default=8000, metadata=key("listen port (0: any free port)", minimum=0, maximum=65535))
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata=key("larger request bodies get 413", minimum=1))
    status_log_interval_s: float = field(
        default=10.0, metadata=key('seconds between "#proxy-queue ..." status lines', positive=True)
    )
    request_timeout_s: float = field(
        default=600.0, metadata=key("seconds one upstream attempt may take, in total", positive=True)
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata=key(
            "seconds a client may take to send a request's headers, then 408 and closed; 0: no limit", minimum=0
        ),
    )
    body_timeout_s: float = field(
        default=60.0,
        metadata=key(
            "seconds a client may take to send an inference request's body once its headers arrived, "
            "then 408 and closed; 0: no limit",
            minimum=0,
        ),
    )
    cors_allow_origins: tuple[str, ...] = field(
        default=("*",),
        metadata=key(
            'origins browsers may call from (CORS): ["*"] any, as SGLang and vLLM allow; [] none; '
            'or a list such as ["https://app.example.com"]'
        ),
    )
    gpu_sample_interval_s: float = field(
        default=5.0,
        metadata=key("seconds between NVML samples for /metrics and /admin/gpus; 0 turns them off", minimum=0),
    )
    shutdown_grace_s: float = field(
        default=20.0,
        metadata=key(
            "seconds the requests in flight get to end after SIGTERM or SIGINT (queued ones get 503 at once); "
            "then they are ended (a stream with an error event, others 503) and the workers stop; "
            "a second signal ends them at once",
            minimum=0,
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthSettings:
    """Where keys come from; all ``None`` means the proxy runs open. Files are absolute paths."""

    api_keys_env: str | None = field(
        default=None,
        metadata=key(
            'environment variable with comma-separated client keys; "KEY:batch" puts a key in the batch class',
            custom=True,
        ),
    )
    api_keys_file: Path | None = field(
        default=None,
        metadata=key(
            'file of client keys, one a line, optional " batch" / " interactive" (relative to the policy)', custom=True
        ),
    )
    admin_key_env: str | None = field(
        default=None, metadata=key("environment variable with the key for /admin/*", custom=True)
    )
    admin_key_file: Path | None = field(
        default=None, metadata=key("file with the key for /admin/* (relative to the policy)", custom=True)
    )

    @property
    def configured(self) -> bool:
        return any(v is not None for v in (self.api_keys_env, self.api_keys_file))


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSettings:
    capacity: int = field(
        default=20000, metadata=key("requests waiting in the proxy; past it clients get 429 + Retry-After", minimum=0)
    )
    timeout_s: float = field(
        default=300.0, metadata=key("longest wait in the proxy's queue in seconds, then 503", positive=True)
    )
    retry_after_s: int = field(
        default=2,
        metadata=key("the Retry-After (seconds) a 429 (queue full) and a 503 (queue timeout) carry", minimum=0),
    )
    default_priority: Priority = field(
        default=Priority.INTERACTIVE, metadata=key("priority of requests without the header")
    )
    priority_header: str = field(
        default="x-pacer-priority",
        metadata=key('request header a client may set to "batch" or "interactive"', custom=True),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    kind: EngineKind = field(
        default=EngineKind.SIM,
        metadata=key(" | ".join(EngineKind) + " (servers the proxy neither starts nor restarts)", custom=True),
    )
    workers: int = field(default=1, metadata=key("managed workers; for external, one per URL", minimum=1, custom=True))
    args: Mapping[str, Any] = field(
        default_factory=_empty_table,
        metadata=key("engine flags by name, with underscores (managed kinds)", custom=True),
    )
    worker_args: tuple[Mapping[str, Any], ...] = field(
        default=(),
        metadata=key(
            "per worker, in order: engine flags over args for that worker only, e.g. "
            f"[{{}}, {{{example_arg(KnobName.MEMORY_FRACTION)} = 0.8}}] (a worker past the list runs args alone; "
            "managed kinds)",
            custom=True,
        ),
    )
    extra_args: tuple[str, ...] = field(
        default=(), metadata=key("more command-line arguments for each worker (managed kinds)", custom=True)
    )
    urls: tuple[str, ...] = field(
        default=(), metadata=key('the workers\' base URLs (kind = "external" only)', custom=True)
    )
    speaks: str = field(
        default=SPOKEN_BY_DEFAULT.value,
        metadata=key("the engine whose metrics and logs external workers speak (a managed kind)", custom=True),
    )
    command: tuple[str, ...] | None = field(
        default=None, metadata=key("launcher argv; not set: the engine's default by kind", custom=True)
    )
    host: str = field(default="127.0.0.1", metadata=key("address the workers listen on"))
    base_port: int = field(
        default=0,
        metadata=key("0: free ports chosen at start; else worker i listens on base_port + i", minimum=0, maximum=65535),
    )
    startup_timeout_s: float = field(
        default=900.0, metadata=key("seconds a worker may take to become ready", positive=True)
    )
    stop_grace_s: float = field(default=10.0, metadata=key("seconds between SIGTERM and SIGKILL", minimum=0))
    keep_on_exit: bool = field(
        default=False,
        metadata=key(
            "a stop of the proxy leaves its workers running for the next proxy to adopt (an upgrade);"
            " a worker no proxy adopts within a minute stops by itself (managed kinds, this host)"
        ),
    )
    env: Mapping[str, str] = field(
        default_factory=_empty_table, metadata=key("environment variables for the workers (strings)", custom=True)
    )
    log_dir: Path = field(
        default=Path(".pacer/logs"), metadata=key("one log file per worker, relative to the current directory")
    )

    @property
    def managed(self) -> bool:
        return self.kind != EngineKind.EXTERNAL

    @property
    def engine(self) -> Engine:
        """The engine the workers speak: the one of ``kind``, or ``speaks`` for external workers."""
        return engine_named(self.speaks if self.kind == EngineKind.EXTERNAL else self.kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class PacingSettings:
    queue_band: tuple[int, int] = field(
        default=(100, 2000), metadata=key("[low, high]: healthy range of each worker's #queue-req", custom=True)
    )
    headroom: int = field(
        default=32,
        metadata=key("dispatch while estimated server queue < band low + headroom (never past high)", minimum=0),
    )
    scrape_interval_s: float = field(
        default=0.5,
        metadata=key(
            "seconds between /metrics reads, on the workers' clock (a simulated worker at time scale k: k times as "
            "often, never under 0.05 s of wall time)",
            positive=True,
        ),
    )
    stale_after_s: float = field(
        default=3.0,
        metadata=key(
            "a worker whose samples are older (seconds) counts as saturated; >= scrape_interval_s", positive=True
        ),
    )
    max_attempts: int = field(default=3, metadata=key("tries per request that produced no output yet", minimum=1))


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSettings:
    """What an operator decides of the controller: whether it acts, how far it may move each engine
    argument, how often it may restart a worker, and where its journal goes. Everything else is a
    constant of the controller, in the engine's seconds (``proxy.control.constants``)."""

    mode: ControlMode = field(
        default=ControlMode.AUTO,
        metadata=key("off: pace only; advise: journal what the controller would change; auto: act"),
    )
    bounds: Mapping[str, tuple[float, ...]] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata=key(
            "the range each engine argument may move in, by the engine's name for it: "
            f"{{ {example_arg(KnobName.CONSERVATIVENESS)} = [0.1, 2.0], {example_arg(KnobName.MAX_RUNNING)} = [8] }}"
            " ([low] alone: no top); "
            "an argument not named keeps the controller's own range (docs/controller.md)",
            custom=True,
        ),
    )
    restarts_per_hour: int = field(
        default=6, metadata=key("restarts the controller may ask for, per worker and hour (safety ones too)", minimum=0)
    )
    revive: bool = field(
        default=True,
        metadata=key(
            "restart a managed worker that died: in auto with safer args when a rule says so, in advise as it was"
        ),
    )
    output_budget: bool = field(
        default=True,
        metadata=key(
            "auto mode, fast tier: send each plain whole request with max_tokens at its class's output budget on "
            "engines that reserve max_tokens (SGLang), a margin over what that worker's answers write, and continue "
            "an answer that reaches it: the engine admits for what answers need, with no restart"
        ),
    )
    journal_path: str | None = field(
        default=".pacer/decisions.jsonl",
        metadata=key("decisions as JSON lines; not set: kept in memory only", custom=True),
    )

    def bound(self, arg: str) -> tuple[float, float] | None:
        """The operator's range for engine argument ``arg`` (a missing top: none), or None when not named."""
        given = self.bounds.get(arg)
        if given is None:
            return None
        return (given[0], given[1] if len(given) > 1 else float("inf"))


class WorkerBackend(StrEnum):
    LOCAL = "local"  # worker processes on this host, started by the proxy
    RAY = "ray"  # each worker a Ray actor owning its engine process on a node with the GPUs it needs


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetSettings:
    """Where managed workers run: on this host, or on a Ray cluster the proxy attaches to."""

    backend: WorkerBackend = field(default=WorkerBackend.LOCAL, metadata=key("local | ray"))
    ray_address: str = field(
        default="auto",
        metadata=key('the Ray cluster to attach to: "auto" (this node\'s), "ray://head:10001", "local" (start one)'),
    )
    ray_namespace: str = field(default="pacer", metadata=key("the Ray namespace of the workers' actors"))
    node_loss_check_s: float = field(
        default=2.0, metadata=key("seconds between checks that each Ray worker's actor is alive", positive=True)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSettings:
    dir: Path = field(
        default=Path(".pacer/batches"),
        metadata=key("the Batch API's database and files, relative to the current directory"),
    )
    concurrency: int = field(
        default=256, metadata=key("batch lines in flight at once (the admission paces them)", minimum=1)
    )


AUTO_GPUS = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolKeys:
    """The keys of a ``[[pool]]`` table beside every ``[engine]`` key (and its ``[pool.control]``)."""

    name: str = field(default="default", metadata=key("the pool's name; its worker ids start with it", custom=True))
    model: str | None = field(
        default=None,
        metadata=key(
            "the model name the pool serves (its workers' served name); requests naming it go to this pool",
            custom=True,
        ),
    )
    tp: int = field(default=1, metadata=key("GPUs per worker (tensor parallel size)", minimum=1))
    gpus: tuple[int, ...] | str | None = field(
        default=None,
        metadata=key(
            'GPU ids, tp per worker in order; "auto": GPUs NVML sees that no other pool names; '
            "not set: no placement (CUDA_VISIBLE_DEVICES left as it is)",
            custom=True,
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSettings:
    """One pool: identical workers serving one model, with their GPUs and their controller's settings.

    A policy with an ``[engine]`` table (or neither table) has one pool named "default"."""

    keys: PoolKeys = PoolKeys()
    engine: EngineSettings = EngineSettings()
    control: ControlSettings = ControlSettings()
    pacing: PacingSettings = PacingSettings()  # [pacing] with the pool's [pool.pacing] over it
    shorthand: bool = True  # from [engine]: worker ids w0, w1, ... as before pools existed

    @property
    def name(self) -> str:
        return self.keys.name

    @property
    def model(self) -> str | None:
        return self.keys.model

    @property
    def tp(self) -> int:
        return self.keys.tp

    @property
    def auto_gpus(self) -> bool:
        return self.keys.gpus == AUTO_GPUS

    @property
    def given_gpus(self) -> tuple[int, ...]:
        """The GPU ids the policy names for this pool (none for "auto" or no placement)."""
        return self.keys.gpus if isinstance(self.keys.gpus, tuple) else ()

    def worker_id(self, index: int) -> str:
        return f"w{index}" if self.shorthand else f"{self.name}-w{index}"

    def gpu_sets(self, visible: int | None = None, taken: frozenset[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
        """The GPU ids of each worker ((): no placement). ``auto`` takes the first ``workers x tp``
        of the ``visible`` GPUs not in ``taken``; PolicyError when there are not enough."""
        k, n = self.keys, self.engine.workers
        if self.auto_gpus:
            if visible is None:
                raise PolicyError(f"pool.{k.name}.gpus", '"auto" needs NVML to see the GPUs, and it sees none')
            free = [g for g in range(visible) if g not in taken]
            if len(free) < n * k.tp:
                raise PolicyError(
                    f"pool.{k.name}.gpus",
                    f'"auto" needs {n * k.tp} GPUs ({n} workers x tp {k.tp}); {len(free)} of {visible} are free',
                )
            ids: tuple[int, ...] = tuple(free[: n * k.tp])
        elif not self.given_gpus:
            return tuple(() for _ in range(n))
        else:
            ids = self.given_gpus
        return tuple(ids[i * k.tp : (i + 1) * k.tp] for i in range(n))


@dataclass(frozen=True, slots=True, kw_only=True)
class KeySettings:
    """One API key's share and limits, ``[admission.keys.NAME]`` (NAME: the key's name in ``[auth]``)."""

    weight: float = field(
        default=1.0, metadata=key("its share of tokens within its class, beside others", positive=True)
    )
    requests_per_minute: int = field(default=0, metadata=key("requests a minute; 0: no limit", minimum=0))
    tokens_per_minute: int = field(
        default=0, metadata=key("estimated tokens (prompt + max_tokens) a minute; 0: no limit", minimum=0)
    )
    max_concurrent: int = field(
        default=0, metadata=key("its requests inside the proxy at once; 0: no limit", minimum=0)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSettings:
    batch_floor_share: float = field(
        default=0.05,
        metadata=key(
            "share of dispatches batch gets while interactive work also waits (batch never starves)",
            minimum=0,
            maximum=1,
        ),
    )
    default_max_tokens: int = field(
        default=256,
        metadata=key(
            "completion tokens a request that gives no max_tokens is assumed to ask for (fair share, limits)", minimum=0
        ),
    )
    quantum_tokens: int = field(
        default=4096, metadata=key("tokens of credit a key of weight 1 gets per turn of the round robin", minimum=1)
    )
    keys: Mapping[str, KeySettings] = field(
        default_factory=dict,
        metadata=key(
            "per key name, a table [admission.keys.NAME] of weight (1.0), requests_per_minute, tokens_per_minute, "
            "max_concurrent (0: no limit); keys not named here get weight 1 and no limits",
            custom=True,
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    proxy: ProxySettings = ProxySettings()
    auth: AuthSettings = AuthSettings()
    queue: QueueSettings = QueueSettings()
    engine: EngineSettings = EngineSettings()
    pacing: PacingSettings = PacingSettings()
    control: ControlSettings = ControlSettings()
    batch: BatchSettings = BatchSettings()
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
        lines = changed_keys(tables, secret=lambda key: ".env." in key or key in secret_args)
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


# table name -> its settings; the order of ``pacer check-policy --defaults``
TABLES: Mapping[str, type[Any]] = MappingProxyType(
    {
        "proxy": ProxySettings,
        "auth": AuthSettings,
        "queue": QueueSettings,
        "engine": EngineSettings,
        "pacing": PacingSettings,
        "control": ControlSettings,
        "batch": BatchSettings,
        "fleet": FleetSettings,
        "admission": AdmissionSettings,
    }
)


def documented_defaults() -> str:
    """Every key of every table with its default and meaning, as TOML (``pacer check-policy --defaults``)."""
    pool = defaults_toml({"pool": PoolKeys}).replace("[pool]", "[[pool]]  # instead of [engine], once per pool", 1)
    return (
        defaults_toml(TABLES)
        + pool
        + "\n# ... and every [engine] key; a [pool.control] table overrides [control] keys for that pool,"
        + " a [pool.pacing] table [pacing] keys\n"
    )


# --------------------------------------------------------------------------------------------------
# loading


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
    control = _control(root.table("control"))
    pacing_table = root.mapping("pacing")
    pacing = _pacing(root.table("pacing"))
    pool_tables = root.raw("pool", None)
    if pool_tables is None:
        engine = _engine(root.table("engine"))
        pools: tuple[PoolSettings, ...] = (PoolSettings(engine=engine, control=control, pacing=pacing),)
    else:
        if root.has("engine"):
            raise root.error("engine", "use either [engine] (one pool) or [[pool]] tables, not both")
        pools = _pools(root, pool_tables, control_table, pacing_table, source)
        engine = pools[0].engine
    policy = Policy(
        proxy=_proxy(root.table("proxy")),
        auth=_auth(root.table("auth"), base),
        queue=_queue(root.table("queue")),
        engine=engine,
        pacing=pacing,
        control=control,
        batch=_batch(root.table("batch")),
        fleet=_fleet(root.table("fleet")),
        pools=pools,
        admission=_admission(root.table("admission")),
        source=source,
    )
    root.finish()
    for p in policy.pools:
        _bounds_known(p, source)
    if policy.fleet.backend is WorkerBackend.LOCAL:
        _ports_apart(policy.pools, source)
    if policy.fleet.backend is WorkerBackend.RAY:
        for p in policy.pools:
            if p.given_gpus:
                raise PolicyError(
                    f"pool.{p.name}.gpus",
                    'on Ray (fleet.backend = "ray") its GPU accounting picks each worker\'s GPUs: use gpus = "auto"',
                    source=source,
                )
    return policy


def _ports_apart(pools: Sequence[PoolSettings], source: str) -> None:
    """Fixed ports on one host: two pools' workers must not share one (on Ray, pools on different
    nodes may)."""
    ports: dict[str, range] = {}
    for p in pools:
        e = p.engine
        if not (e.managed and e.base_port):
            continue
        mine = range(e.base_port, e.base_port + e.workers)
        for other, theirs in ports.items():
            if mine.start < theirs.stop and theirs.start < mine.stop:
                raise PolicyError(
                    f"pool.{p.name}.base_port",
                    f"ports {mine.start}..{mine.stop - 1} overlap those of pool {other!r} ({theirs.start}..{theirs.stop - 1})",
                    source=source,
                )
        ports[p.name] = mine


def _pools(
    root: Table, tables: object, control: Mapping[str, Any], pacing: Mapping[str, Any], source: str
) -> tuple[PoolSettings, ...]:
    if not isinstance(tables, list) or not tables:
        raise root.error("pool", "expected [[pool]] tables (an array of tables)")
    pools = [_pool(Table(data, f"pool[{i}]", source), control, pacing, source) for i, data in enumerate(tables)]
    names: dict[str, int] = {}
    models: dict[str, str] = {}
    owner: dict[int, str] = {}
    for i, p in enumerate(pools):
        if p.name in names:
            raise PolicyError(f"pool[{i}].name", f"{p.name!r} is also pool[{names[p.name]}]", source=source)
        names[p.name] = i
        if len(pools) > 1 and p.model is None:
            raise PolicyError(f"pool.{p.name}.model", "required when there are several pools", source=source)
        if p.model is not None:
            if p.model in models:
                raise PolicyError(
                    f"pool.{p.name}.model", f"{p.model!r} is served by pool {models[p.model]!r} too", source=source
                )
            models[p.model] = p.name
        for g in p.given_gpus:
            if g in owner:
                raise PolicyError(
                    f"pool.{p.name}.gpus", f"GPU {g} is given twice (pool {owner[g]!r} has it)", source=source
                )
            owner[g] = p.name
    return tuple(pools)


def _pool(t: Table, control: Mapping[str, Any], pacing: Mapping[str, Any], source: str) -> PoolSettings:
    name = t.str("name", None)
    if name is None:
        raise t.error("name", "every [[pool]] needs a name")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise t.error("name", f"letters, digits, - and _ only (it names the workers); got {name!r}")
    model = t.str("model", None)
    tp = t.int("tp", PoolKeys().tp, minimum=1)
    raw_gpus = t.raw("gpus", None)
    auto = raw_gpus == AUTO_GPUS
    gpus: tuple[int, ...] | None = None
    if raw_gpus is not None and not auto:
        if not isinstance(raw_gpus, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in raw_gpus
        ):
            raise t.error("gpus", f'expected GPU ids (integers >= 0) or "auto", got {raw_gpus!r}')
        if len(set(raw_gpus)) != len(raw_gpus):
            twice = next(g for g in raw_gpus if raw_gpus.count(g) > 1)
            raise t.error("gpus", f"GPU {twice} is given twice")
        if not raw_gpus:
            raise t.error("gpus", 'is empty: give the GPU ids, "auto", or leave it out (no placement)')
        if len(raw_gpus) % tp:
            raise t.error("gpus", f"tp = {tp} does not divide the {len(raw_gpus)} GPUs given")
        gpus = tuple(raw_gpus)
    overrides = t.mapping("control")
    pool_control = _control(Table({**control, **overrides}, f"pool[{name}].control", source))
    pool_pacing = _pacing(Table({**pacing, **t.mapping("pacing")}, f"pool[{name}].pacing", source))
    if gpus is not None:
        per_gpus = len(gpus) // tp
        if t.has("workers") and t.raw("workers") != per_gpus:
            raise t.error("workers", f"{len(gpus)} GPUs at tp {tp} make {per_gpus} workers, not {t.raw('workers')!r}")
    engine = _engine(
        t,
        workers=len(gpus) // tp if gpus is not None else None,
        in_pool=True,
        placed=tp > 1 or gpus is not None or auto,
        model=model,
    )
    return PoolSettings(
        keys=PoolKeys(name=name, model=model, tp=tp, gpus=AUTO_GPUS if auto else gpus),
        engine=engine,
        control=pool_control,
        pacing=pool_pacing,
        shorthand=False,
    )


def _proxy(t: Table) -> ProxySettings:
    s = read_settings(t, ProxySettings)
    t.finish()
    return s


def _auth(t: Table, base: Path) -> AuthSettings:
    def path(name: str) -> Path | None:
        value = t.str(name, None)
        return None if value is None else (base / Path(value).expanduser())

    s = AuthSettings(
        api_keys_env=t.str("api_keys_env", None),
        api_keys_file=path("api_keys_file"),
        admin_key_env=t.str("admin_key_env", None),
        admin_key_file=path("admin_key_file"),
    )
    t.finish()
    return s


def _batch(t: Table) -> BatchSettings:
    s = read_settings(t, BatchSettings)
    t.finish()
    return s


def _fleet(t: Table) -> FleetSettings:
    s = read_settings(t, FleetSettings)
    t.finish()
    return s


def _admission(t: Table) -> AdmissionSettings:
    keys_table = t.table("keys")
    keys: dict[str, KeySettings] = {}
    for name in keys_table.mapping_names():
        sub = keys_table.table(name)
        keys[name] = read_settings(sub, KeySettings)
        sub.finish()
    keys_table.finish()
    s = read_settings(t, AdmissionSettings, {"keys": MappingProxyType(keys)})
    t.finish()
    return s


def _queue(t: Table) -> QueueSettings:
    d = QueueSettings()
    header = t.str("priority_header", d.priority_header) or d.priority_header
    s = read_settings(t, QueueSettings, {"priority_header": header.lower()})
    t.finish()
    return s


def _engine(
    t: Table, *, workers: int | None = None, in_pool: bool = False, placed: bool = False, model: str | None = None
) -> EngineSettings:
    """One engine table; in a pool, ``workers`` comes from its GPUs when given, and the arguments
    that placement sets (``tp_size``, the served name) may not be set by hand."""
    d = EngineSettings()
    kind = t.enum("kind", EngineKind, d.kind)
    managed = kind != EngineKind.EXTERNAL
    workers = t.int("workers", d.workers if workers is None else workers, minimum=1)
    args = t.mapping("args")
    worker_args = t.raw("worker_args", [])
    if not isinstance(worker_args, list) or not all(isinstance(a, Mapping) for a in worker_args):
        example = f"[{{}}, {{{example_arg(KnobName.MEMORY_FRACTION, kind)} = 0.8}}]"
        raise t.error("worker_args", f"expected an array of tables, one per worker, e.g. {example}")
    extra_args = t.str_list("extra_args", []) or ()
    urls = t.str_list("urls", None)
    speaks = t.str("speaks", None)
    command = t.str_list("command", None)
    env = t.mapping("env")
    for name, value in env.items():
        if not isinstance(value, str):
            raise t.error(f"env.{name}", f"expected a string, got {value!r} (quote it)")

    if managed:
        for name, given in (("urls", urls), ("speaks", speaks)):
            if given is not None:
                raise t.error(name, f'only for kind = "external" (kind is "{kind}")')
        if command is not None and not command:
            raise t.error("command", "must not be empty (leave it out for the default launcher)")
        _check_args(t, kind, args)
        if len(worker_args) > workers:
            raise t.error("worker_args", f"{len(worker_args)} tables for {workers} workers")
        for i, own in enumerate(worker_args):
            _check_args(t, kind, own, f"worker_args[{i}]")
        if in_pool:
            for name in engine_named(kind).placement_args(1, model):
                for where, given in (("args", args), *((f"worker_args[{i}]", a) for i, a in enumerate(worker_args))):
                    if name in given:
                        raise t.error(f"{where}.{name}", "set by the pool (its tp and model keys)")
        if problem := engine_named(kind).check_extra_args(extra_args):
            raise t.error("extra_args", problem)
        for name in engine_named(kind).required_args():
            if name not in args:
                raise t.error(f"args.{name}", f'required for kind = "{kind}"')
    else:
        if not urls:
            raise t.error("urls", 'kind = "external" needs at least one URL, e.g. urls = ["http://10.0.0.5:30000"]')
        for i, url in enumerate(urls):
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise t.error(f"urls[{i}]", f"expected an http(s)://host:port URL, got {url!r}")
        if speaks is not None and speaks not in ENGINES:
            raise t.error("speaks", f"expected one of {', '.join(ENGINES)}; got {speaks!r}")
        for name, used in (("args", args), ("worker_args", worker_args), ("extra_args", extra_args),
                           ("command", command), ("env", env)):  # fmt: skip
            if used:
                raise t.error(name, 'not used with kind = "external" (the proxy does not start those servers)')
        if placed:
            raise t.error("gpus", 'not for kind = "external" (the proxy does not place those servers)')
        if t.has("workers") and workers != len(urls):
            raise t.error("workers", f'kind = "external" runs one worker per URL ({len(urls)}); leave workers out')
        workers = len(urls)

    read_here: dict[str, Any] = {
        "kind": kind,
        "workers": workers,
        "args": MappingProxyType(args),
        "worker_args": tuple(MappingProxyType(dict(a)) for a in worker_args),
        "extra_args": tuple(extra_args),
        "urls": tuple(u.rstrip("/") for u in urls or ()),
        "speaks": speaks or d.speaks,
        "command": command,
        "env": MappingProxyType(env),
    }
    s = read_settings(t, EngineSettings, read_here)
    if managed and s.base_port and s.base_port + workers - 1 > 65535:
        raise t.error("base_port", f"base_port + workers - 1 = {s.base_port + workers - 1} is past 65535")
    t.finish()
    return s


def _check_args(t: Table, kind: EngineKind, args: Mapping[str, Any], where: str = "args") -> None:
    engine = engine_named(kind)
    for name, value in args.items():
        problem = engine.check_arg(name, value)
        if problem:
            raise t.error(f"{where}.{name}", problem)


def _pacing(t: Table) -> PacingSettings:
    d = PacingSettings()
    band = t.raw("queue_band", list(d.queue_band))
    if (
        not isinstance(band, list)
        or len(band) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in band)
    ):
        raise t.error("queue_band", f"expected [low, high], two integers; got {band!r}")
    low, high = band
    if low < 0:
        raise t.error("queue_band", f"low must be >= 0, got {low}")
    if low > high:
        raise t.error("queue_band", f"low must be <= high, got [{low}, {high}]")
    s = read_settings(t, PacingSettings, {"queue_band": (low, high)})
    if s.stale_after_s < s.scrape_interval_s:
        raise t.error(
            "stale_after_s", f"must be >= scrape_interval_s ({s.scrape_interval_s:g}), got {s.stale_after_s:g}"
        )
    t.finish()
    return s


def _control(t: Table) -> ControlSettings:
    d = ControlSettings()
    journal = t.raw("journal_path", d.journal_path)
    if journal is not None and (not isinstance(journal, str) or not journal.strip()):
        raise t.error("journal_path", f'expected a file path ("" is not one), got {journal!r}')
    s = read_settings(t, ControlSettings, {"journal_path": journal, "bounds": _arg_bounds(t)})
    t.finish()
    return s


def _arg_bounds(t: Table) -> Mapping[str, tuple[float, ...]]:
    """``bounds``: engine argument -> ``[low]`` or ``[low, high]``, numbers >= 0 with low <= high (the
    names are checked against the pool's engine once it is known: :func:`_bounds_known`)."""
    table = t.mapping("bounds")
    out: dict[str, tuple[float, ...]] = {}
    for name, value in table.items():
        where = f"bounds.{name}"
        if not isinstance(value, list) or len(value) not in (1, 2) or not all(_is_number(v) for v in value):
            raise t.error(where, f"expected [low, high] or [low], numbers; got {value!r}")
        numbers = tuple(float(v) for v in value)
        if numbers[0] < 0 or (len(numbers) == 2 and numbers[0] > numbers[1]):
            raise t.error(where, f"expected 0 <= low <= high, got {list(numbers)!r}")
        out[name] = numbers
    return MappingProxyType(out)


def _bounds_known(pool: PoolSettings, source: str) -> None:
    """Every ``control.bounds`` name is an argument the pool's engine lets the controller move."""
    args = sorted(knob.arg for knob in pool.engine.engine.knobs.values())
    for name in pool.control.bounds:
        if name not in args:
            where = "control" if pool.shorthand else f"pool.{pool.name}.control"
            raise PolicyError(
                f"{where}.bounds.{name}",
                f"not an argument the controller moves on {pool.engine.engine.name}; it moves {', '.join(args)}",
                source=source,
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        + "".join(f", {arg} in [{', '.join(f'{v:g}' for v in r)}]" for arg, r in sorted(c.bounds.items()))
    )
    lines.append(f"  batch    /v1/batches kept in {p.batch.dir}, {p.batch.concurrency} lines in flight at most")
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
