"""The deployment policy: one TOML file that says how the proxy listens, queues, runs and paces.

    policy = load_policy("policies/default.toml")      # raises PolicyError naming the bad key
    policy.engine.kind, policy.pacing.queue_band, policy.describe()

Every table is optional and every key has a default, so ``parse_policy({}, "<empty>")`` is a valid
policy (one simulated worker). Unknown keys are errors. Engine args are checked against the
engine's own flag table (``proxy.engines.<engine>.argv.check_arg``) so a typo fails here, not
minutes later when a GPU worker refuses to start.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

from proxy.engines.registry import engine_spec
from proxy.policy_schema import PolicyError, Table

__all__ = [
    "AuthSettings",
    "ControlMode",
    "ControlSettings",
    "EngineKind",
    "EngineSettings",
    "PacingSettings",
    "Policy",
    "PolicyError",
    "Priority",
    "ProxySettings",
    "QueueSettings",
    "load_policy",
    "parse_policy",
]


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class EngineKind(StrEnum):
    SIM = "sim"  # the simulated SGLang engine (pacer sim)
    SGLANG = "sglang"
    VLLM = "vllm"
    EXTERNAL = "external"  # servers the proxy neither starts nor restarts


class ControlMode(StrEnum):
    AUTO = "auto"  # the controller restarts workers with retuned args
    ADVISE = "advise"  # the controller logs what it would do
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies -> 413
    status_log_interval_s: float = 10.0  # periodic "#proxy-queue ..." log line
    request_timeout_s: float = 600.0  # one upstream attempt, total
    gpu_sample_interval_s: float = 5.0  # NVML sample for /metrics and /admin/gpus; 0 turns it off


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthSettings:
    """Where keys come from; all ``None`` means the proxy runs open. Files are absolute paths."""

    api_keys_env: str | None = None  # comma-separated keys; "KEY:batch" puts a key in the batch class
    api_keys_file: Path | None = None  # one key per line, optional " batch" / " interactive"
    admin_key_env: str | None = None
    admin_key_file: Path | None = None

    @property
    def configured(self) -> bool:
        return any(v is not None for v in (self.api_keys_env, self.api_keys_file))


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSettings:
    capacity: int = 20000  # past it -> 429 with Retry-After
    timeout_s: float = 300.0  # longest wait in the proxy queue -> 503
    retry_after_s: int = 2
    default_priority: Priority = Priority.INTERACTIVE
    priority_header: str = "x-pacer-priority"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    kind: EngineKind = EngineKind.SIM
    workers: int = 1  # managed workers; for external, len(urls)
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # engine flag names, underscores
    extra_args: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()  # kind = "external" only
    speaks: str = "sglang"  # the engine whose metrics/logs the workers speak: sglang | vllm
    command: tuple[str, ...] | None = None  # launcher; None -> proxy.engines.registry default by kind
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: free ports chosen at start; else base_port + i
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 10.0
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    log_dir: Path = Path(".pacer/logs")  # relative to the current directory

    @property
    def managed(self) -> bool:
        return self.kind != EngineKind.EXTERNAL

    @property
    def engine(self) -> str:
        """The engine package the workers speak: "sglang" for sim/sglang, else vllm or ``speaks``."""
        if self.kind == EngineKind.EXTERNAL:
            return self.speaks
        return "vllm" if self.kind == EngineKind.VLLM else "sglang"


@dataclass(frozen=True, slots=True, kw_only=True)
class PacingSettings:
    queue_band: tuple[int, int] = (100, 2000)  # healthy range of each worker's #queue-req
    headroom: int = 32  # dispatch while estimated server queue < band low + headroom (never past high)
    scrape_interval_s: float = 0.5
    stale_after_s: float = 3.0  # older samples count as saturated
    max_attempts: int = 3  # tries per request that produced no output yet


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlSettings:
    """The controller's settings: when it looks, what counts as evidence, how far it may move a knob."""

    mode: ControlMode = ControlMode.OFF
    # -- rhythm and restraint (proxy.control)
    interval_s: float = 5.0  # how often the rules run
    window_s: float = 60.0  # how far back a rule looks
    min_evidence_s: float = 20.0  # a rule needs this much observed time since the worker (re)started
    cooldown_s: float = 120.0  # after a restart, tuning rules leave that worker alone this long
    restarts_per_hour: int = 6  # per worker, restarts the controller asks for
    flip_guard_s: float = 1800.0  # a knob moved one way is not moved back by a tuning rule within this long
    good_after_s: float = 120.0  # args that ran this long without a crash become the fallback
    crash_loop: int = 3  # deaths within crash_loop_window_s that make a crash loop
    crash_loop_window_s: float = 600.0
    crash_backoff_s: tuple[float, ...] = (1.0, 5.0, 15.0, 30.0, 60.0)  # wait before reviving a dead worker
    drain_timeout_s: float = 60.0  # longest wait for running requests before a restart
    revive: bool = True  # in auto mode, restart a managed worker that died (with safer args when a rule says so)
    journal_path: str | None = ".pacer/decisions.jsonl"  # JSON lines; none: in memory only
    # -- thresholds and steps of the rules
    low_usage: float = 0.9  # token usage below this with a non-empty server queue ...
    low_usage_fraction: float = 0.7  # ... for this fraction of the window: admission too conservative
    timid_queue_fraction: float = 0.5  # server queue empty this often while the proxy holds work: noted
    retractions_per_min: float = 6.0  # retracted requests per minute: below this, never a storm (noise floor)
    retractions_per_1k_tokens: float = 0.5  # retracted requests per 1k output tokens above this: admission too aggressive
    admission_min_gain: float = 0.15  # lower the conservativeness only if the batch could grow by this much (low_usage / usage - 1)
    conservativeness_bounds: tuple[float, float] = (0.1, 2.0)
    conservativeness_step: float = 0.3
    prefill_chunk_min: int = 2048  # a prefill OOM halves the chunk down to this
    decode_oom_factor: float = 0.8  # a decode OOM sets max running requests to the peak seen x this
    max_running_min: int = 8
    available_mem_band_gb: tuple[float, float] = (5.0, 10.0)  # start-up free memory outside it moves the KV fraction
    memory_fraction_step: float = 0.01
    memory_fraction_bounds: tuple[float, float] = (0.5, 0.95)


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    proxy: ProxySettings = ProxySettings()
    auth: AuthSettings = AuthSettings()
    queue: QueueSettings = QueueSettings()
    engine: EngineSettings = EngineSettings()
    pacing: PacingSettings = PacingSettings()
    control: ControlSettings = ControlSettings()
    source: str = "<defaults>"  # the file it came from

    def describe(self) -> str:
        """A few lines for ``pacer check-policy`` and the start-up log."""
        return "\n".join(_describe(self))


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
    policy = Policy(
        proxy=_proxy(root.table("proxy")),
        auth=_auth(root.table("auth"), base),
        queue=_queue(root.table("queue")),
        engine=_engine(root.table("engine")),
        pacing=_pacing(root.table("pacing")),
        control=_control(root.table("control")),
        source=source,
    )
    root.finish()
    return policy


def _proxy(t: Table) -> ProxySettings:
    d = ProxySettings()
    s = ProxySettings(
        host=t.str("host", d.host) or d.host,
        port=t.int("port", d.port, minimum=0, maximum=65535),
        max_body_bytes=t.int("max_body_bytes", d.max_body_bytes, minimum=1),
        status_log_interval_s=t.float("status_log_interval_s", d.status_log_interval_s, positive=True),
        request_timeout_s=t.float("request_timeout_s", d.request_timeout_s, positive=True),
        gpu_sample_interval_s=t.float("gpu_sample_interval_s", d.gpu_sample_interval_s, minimum=0),
    )
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


def _queue(t: Table) -> QueueSettings:
    d = QueueSettings()
    s = QueueSettings(
        capacity=t.int("capacity", d.capacity, minimum=0),
        timeout_s=t.float("timeout_s", d.timeout_s, positive=True),
        retry_after_s=t.int("retry_after_s", d.retry_after_s, minimum=0),
        default_priority=t.enum("default_priority", Priority, d.default_priority),
        priority_header=(t.str("priority_header", d.priority_header) or d.priority_header).lower(),
    )
    t.finish()
    return s


def _engine(t: Table) -> EngineSettings:
    d = EngineSettings()
    kind = t.enum("kind", EngineKind, d.kind)
    managed = kind != EngineKind.EXTERNAL
    workers = t.int("workers", d.workers, minimum=1)
    args = t.mapping("args")
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
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in extra_args):
                raise t.error("extra_args", f"{flag} is set by the supervisor (use engine.host / engine.base_port)")
        if kind == EngineKind.SGLANG and "model_path" not in args:
            raise t.error("args.model_path", 'required for kind = "sglang"')
    else:
        if not urls:
            raise t.error("urls", 'kind = "external" needs at least one URL, e.g. urls = ["http://10.0.0.5:30000"]')
        for i, url in enumerate(urls):
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise t.error(f"urls[{i}]", f"expected an http(s)://host:port URL, got {url!r}")
        if speaks is not None and speaks not in ("sglang", "vllm"):
            raise t.error("speaks", f"expected one of sglang, vllm; got {speaks!r}")
        for name, given in (("args", args), ("extra_args", extra_args), ("command", command), ("env", env)):
            if given:
                raise t.error(name, 'not used with kind = "external" (the proxy does not start those servers)')
        if t.has("workers") and workers != len(urls):
            raise t.error("workers", f'kind = "external" runs one worker per URL ({len(urls)}); leave workers out')
        workers = len(urls)

    s = EngineSettings(
        kind=kind,
        workers=workers,
        args=MappingProxyType(args),
        extra_args=tuple(extra_args),
        urls=tuple(u.rstrip("/") for u in urls or ()),
        speaks=speaks or d.speaks,
        command=command,
        host=t.str("host", d.host) or d.host,
        base_port=t.int("base_port", d.base_port, minimum=0, maximum=65535),
        startup_timeout_s=t.float("startup_timeout_s", d.startup_timeout_s, positive=True),
        stop_grace_s=t.float("stop_grace_s", d.stop_grace_s, minimum=0),
        env=MappingProxyType(env),
        log_dir=Path(t.str("log_dir", str(d.log_dir)) or d.log_dir),
    )
    if managed and s.base_port and s.base_port + workers - 1 > 65535:
        raise t.error("base_port", f"base_port + workers - 1 = {s.base_port + workers - 1} is past 65535")
    t.finish()
    return s


def _check_args(t: Table, kind: EngineKind, args: Mapping[str, Any]) -> None:
    checker = _arg_checker(kind)
    if checker is None:
        return
    for name, value in args.items():
        problem = checker(name, value)
        if problem:
            raise t.error(f"args.{name}", problem)


def _arg_checker(kind: EngineKind) -> Callable[[str, object], str | None] | None:
    """The engine's ``check_arg(name, value) -> problem | None``; None where the engine has none yet."""
    if kind in (EngineKind.SIM, EngineKind.SGLANG):
        from proxy.engines.sglang.argv import check_arg

        allow_sim = kind == EngineKind.SIM
        return lambda name, value: check_arg(name, value, allow_sim=allow_sim)
    try:
        return engine_spec(str(kind)).function("argv", "check_arg")
    except (ImportError, AttributeError):
        return None


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
    s = PacingSettings(
        queue_band=(low, high),
        headroom=t.int("headroom", d.headroom, minimum=0),
        scrape_interval_s=t.float("scrape_interval_s", d.scrape_interval_s, positive=True),
        stale_after_s=t.float("stale_after_s", d.stale_after_s, positive=True),
        max_attempts=t.int("max_attempts", d.max_attempts, minimum=1),
    )
    if s.stale_after_s < s.scrape_interval_s:
        raise t.error("stale_after_s", f"must be >= scrape_interval_s ({s.scrape_interval_s:g}), got {s.stale_after_s:g}")
    t.finish()
    return s


def _control(t: Table) -> ControlSettings:
    d = ControlSettings()
    fraction = {"low_usage", "low_usage_fraction", "timid_queue_fraction", "decode_oom_factor"}
    floats = {
        name: t.float(name, getattr(d, name), positive=True)
        for name in (
            "interval_s", "window_s", "min_evidence_s", "good_after_s", "crash_loop_window_s", "drain_timeout_s",
            "retractions_per_min", "retractions_per_1k_tokens", "admission_min_gain", "conservativeness_step", "memory_fraction_step", *sorted(fraction),
        )
    }  # fmt: skip
    for name in sorted(fraction):
        if floats[name] > 1:
            raise t.error(name, f"must be <= 1, got {floats[name]!r}")
    for name in ("cooldown_s", "flip_guard_s"):
        floats[name] = t.float(name, getattr(d, name), minimum=0)
    backoff = t.raw("crash_backoff_s", list(d.crash_backoff_s))
    if not isinstance(backoff, list) or not backoff or not all(_is_number(v) and v >= 0 for v in backoff):
        raise t.error("crash_backoff_s", f"expected a non-empty array of seconds >= 0, got {backoff!r}")
    journal = t.raw("journal_path", d.journal_path)
    if journal is not None and (not isinstance(journal, str) or not journal.strip()):
        raise t.error("journal_path", f'expected a file path ("" is not one), got {journal!r}')
    revive = t.raw("revive", d.revive)
    if not isinstance(revive, bool):
        raise t.error("revive", f"expected true or false, got {revive!r}")
    s = ControlSettings(
        mode=t.enum("mode", ControlMode, d.mode),
        **floats,
        restarts_per_hour=t.int("restarts_per_hour", d.restarts_per_hour, minimum=0),
        crash_loop=t.int("crash_loop", d.crash_loop, minimum=1),
        crash_backoff_s=tuple(float(v) for v in backoff),
        revive=revive,
        journal_path=journal,
        conservativeness_bounds=_bounds(t, "conservativeness_bounds", d.conservativeness_bounds),
        prefill_chunk_min=t.int("prefill_chunk_min", d.prefill_chunk_min, minimum=1),
        max_running_min=t.int("max_running_min", d.max_running_min, minimum=1),
        available_mem_band_gb=_bounds(t, "available_mem_band_gb", d.available_mem_band_gb),
        memory_fraction_bounds=_bounds(t, "memory_fraction_bounds", d.memory_fraction_bounds, maximum=1.0),
    )
    if s.min_evidence_s > s.window_s:
        raise t.error("min_evidence_s", f"must be <= window_s ({s.window_s:g}), got {s.min_evidence_s:g}")
    t.finish()
    return s


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds(t: Table, name: str, default: tuple[float, float], *, maximum: float | None = None) -> tuple[float, float]:
    """A ``[low, high]`` pair of numbers >= 0 with low <= high (and high <= maximum)."""
    value = t.raw(name, list(default))
    if not isinstance(value, list) or len(value) != 2 or not all(_is_number(v) for v in value):
        raise t.error(name, f"expected [low, high], two numbers; got {value!r}")
    low, high = float(value[0]), float(value[1])
    if low < 0 or low > high or (maximum is not None and high > maximum):
        limit = f" <= {maximum:g}" if maximum is not None else ""
        raise t.error(name, f"expected 0 <= low <= high{limit}, got [{low:g}, {high:g}]")
    return (low, high)


# --------------------------------------------------------------------------------------------------
# describe


def _describe(p: Policy) -> list[str]:
    e, q, pc, a = p.engine, p.queue, p.pacing, p.auth
    lines = [f"policy {p.source}"]
    lines.append(
        f"  proxy    listen {p.proxy.host}:{p.proxy.port}, body <= {p.proxy.max_body_bytes} bytes, "
        f"upstream timeout {p.proxy.request_timeout_s:g} s"
    )
    if a.configured:
        sources = [f"env {a.api_keys_env}" if a.api_keys_env else "", f"file {a.api_keys_file}" if a.api_keys_file else ""]
        lines.append(f"  auth     API keys from {' and '.join(s for s in sources if s)}")
    else:
        lines.append("  auth     open (no API keys configured)")
    if a.admin_key_env or a.admin_key_file:
        lines.append(f"           admin key from {a.admin_key_env and 'env ' + a.admin_key_env or 'file ' + str(a.admin_key_file)}")
    lines.append(
        f"  queue    capacity {q.capacity}, wait <= {q.timeout_s:g} s, default priority {q.default_priority}"
        f" (header {q.priority_header})"
    )
    if e.managed:
        ports = "free ports" if e.base_port == 0 else f"ports {e.base_port}..{e.base_port + e.workers - 1}"
        lines.append(f"  engine   {e.kind} x{e.workers} on {e.host} ({ports}), logs in {e.log_dir}")
        if e.command:
            lines.append(f"           command {' '.join(e.command)}")
        shown = " ".join(f"{k}={'***' if 'key' in k else v}" for k, v in sorted(e.args.items()))
        lines.append(f"           args {shown or '(engine defaults)'}")
        if e.extra_args:
            lines.append(f"           extra {' '.join(e.extra_args)}")
    else:
        lines.append(f"  engine   external ({e.speaks}): {', '.join(e.urls)}")
    lines.append(
        f"  pacing   queue band [{pc.queue_band[0]}, {pc.queue_band[1]}], headroom {pc.headroom}, "
        f"scrape every {pc.scrape_interval_s:g} s (stale after {pc.stale_after_s:g} s), {pc.max_attempts} attempts"
    )
    c = p.control
    lines.append(
        f"  control  {c.mode}: rules every {c.interval_s:g} s over {c.window_s:g} s, cool-down {c.cooldown_s:g} s, "
        f"<= {c.restarts_per_hour} restarts/h per worker"
    )
    return lines
