"""Reading a policy's TOML tables into its settings, with the checks that span keys.

One function per table (``read_proxy``, ``read_engine``, ``read_pools`` ...) reads it through
:class:`proxy.policy_schema.Table`, which names the bad key in its :class:`PolicyError`; the checks
that need several tables (ports apart, bounds the engine knows) take the settings already read.
Engine args are checked against the engine's own flag table so a typo fails here, not when a
worker refuses to start. :func:`proxy.policy.parse_policy` puts the tables together.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlparse

from proxy.engines.base import KnobName
from proxy.engines.registry import ENGINES, EngineKind, engine_named, example_arg
from proxy.policy_schema import PolicyError, Table, read_settings
from proxy.policy_settings import (
    AUTO_GPUS,
    AdmissionSettings,
    AuthSettings,
    BatchSettings,
    ControlSettings,
    EngineSettings,
    FleetSettings,
    KeySettings,
    PacingSettings,
    PoolKeys,
    PoolSettings,
    ProxySettings,
    QueueSettings,
    StoreSettings,
)

__all__ = [
    "bounds_known",
    "ports_apart",
    "read_admission",
    "read_auth",
    "read_batch",
    "read_control",
    "read_engine",
    "read_fleet",
    "read_pacing",
    "read_pools",
    "read_proxy",
    "read_queue",
    "read_store",
]


def ports_apart(pools: Sequence[PoolSettings], source: str) -> None:
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


def read_pools(
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
    pool_control = read_control(Table({**control, **overrides}, f"pool[{name}].control", source))
    pool_pacing = read_pacing(Table({**pacing, **t.mapping("pacing")}, f"pool[{name}].pacing", source))
    if gpus is not None:
        per_gpus = len(gpus) // tp
        if t.has("workers") and t.raw("workers") != per_gpus:
            raise t.error("workers", f"{len(gpus)} GPUs at tp {tp} make {per_gpus} workers, not {t.raw('workers')!r}")
    engine = read_engine(
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


def read_proxy(t: Table) -> ProxySettings:
    s = read_settings(t, ProxySettings)
    t.finish()
    return s


def read_auth(t: Table, base: Path) -> AuthSettings:
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


def read_batch(t: Table) -> BatchSettings:
    s = read_settings(t, BatchSettings)
    t.finish()
    return s


def read_store(t: Table) -> StoreSettings:
    """``[store]``: ``url`` empty (the embedded SQLite) or a PostgreSQL URL, with its driver installed."""
    url = t.str("url", "", nonempty=False) or ""
    url_env = t.str("url_env", None)
    if url and url_env:
        raise t.error("url_env", "give the store's url or the variable that holds it (url_env), not both")
    if url and (problem := store_url_problem(url)):
        raise t.error("url", problem)
    if url_env and importlib.util.find_spec("psycopg") is None:
        raise t.error("url_env", "a PostgreSQL store needs its driver: pip install 'sglang-pacer[postgres]'")
    s = read_settings(t, StoreSettings, {"url": url, "url_env": url_env})
    t.finish()
    return s


def store_url_problem(url: str) -> str | None:
    """What is wrong with a non-empty ``store.url`` (None: a PostgreSQL URL whose driver is there)."""
    scheme = urlparse(url).scheme
    if scheme in ("sqlite", "file"):
        return "the embedded SQLite needs no URL: leave store.url empty (batch.dir holds its file)"
    if scheme not in ("postgresql", "postgres"):
        return f'expected empty or a "postgresql://..." URL, got a {scheme or "scheme-less"!r} one'
    if importlib.util.find_spec("psycopg") is None:
        return "a PostgreSQL store needs its driver: pip install 'sglang-pacer[postgres]'"
    return None


def read_fleet(t: Table) -> FleetSettings:
    s = read_settings(t, FleetSettings)
    t.finish()
    return s


def read_admission(t: Table) -> AdmissionSettings:
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


def read_queue(t: Table) -> QueueSettings:
    d = QueueSettings()
    header = t.str("priority_header", d.priority_header) or d.priority_header
    s = read_settings(t, QueueSettings, {"priority_header": header.lower()})
    t.finish()
    return s


def read_engine(
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


def read_pacing(t: Table) -> PacingSettings:
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


def read_control(t: Table) -> ControlSettings:
    d = ControlSettings()
    journal = t.raw("journal_path", d.journal_path)
    if journal is not None and (not isinstance(journal, str) or not journal.strip()):
        raise t.error("journal_path", f'expected a file path ("" is not one), got {journal!r}')
    s = read_settings(t, ControlSettings, {"journal_path": journal, "bounds": _arg_bounds(t)})
    t.finish()
    return s


def _arg_bounds(t: Table) -> Mapping[str, tuple[float, ...]]:
    """``bounds``: engine argument -> ``[low]`` or ``[low, high]``, numbers >= 0 with low <= high (the
    names are checked against the pool's engine once it is known: :func:`bounds_known`)."""
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


def bounds_known(pool: PoolSettings, source: str) -> None:
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
