"""The policy's settings: one frozen dataclass per TOML table, each key a field with its default.

Each field's metadata (:func:`proxy.policy_schema.key`) holds its meaning and bounds, so the
reader of the plain keys, :meth:`proxy.policy.Policy.changed` and :func:`documented_defaults`
(``pacer check-policy --defaults``) derive from these declarations. Reading and checking a policy
file is :mod:`proxy.policy_read`'s; the whole policy is :class:`proxy.policy.Policy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from proxy.engines.base import KnobName
from proxy.engines.contract import Engine
from proxy.engines.registry import SPOKEN_BY_DEFAULT, EngineKind, engine_named, example_arg
from proxy.policy_schema import PolicyError, defaults_toml, key

__all__ = [
    "AUTO_GPUS",
    "TABLES",
    "AdmissionSettings",
    "AuthSettings",
    "BatchSettings",
    "ControlMode",
    "ControlSettings",
    "EngineSettings",
    "FleetSettings",
    "KeySettings",
    "PacingSettings",
    "PoolKeys",
    "PoolSettings",
    "Priority",
    "ProxySettings",
    "QueueSettings",
    "WorkerBackend",
    "documented_defaults",
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
    reshape: bool = field(
        default=False,
        metadata=key(
            "a pool's control (not the [engine] table's), auto mode: change how many workers share its GPUs at which tp "
            "(one tp-8 worker, two tp-4...) where the twin says another shape serves more, by the same "
            "rolling, canary-first restart; advise mode journals the comparison whatever this says"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSettings:
    """Where durable state lives: the embedded SQLite (in ``batch.dir``) or a PostgreSQL server that
    several replicas share."""

    url: str = field(
        default="",
        metadata=key(
            'empty: the embedded SQLite file in batch.dir; "postgresql://user:password@host:5432/db": a server '
            "the replicas share (pip install 'sglang-pacer[postgres]')",
            custom=True,
        ),
    )
    url_env: str | None = field(
        default=None,
        metadata=key(
            "an environment variable holding the url instead (a Kubernetes Secret's, say): pacer serve reads it "
            "when it starts, and refuses to start without it",
            custom=True,
        ),
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
        "store": StoreSettings,
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
