"""The engine contract: everything the rest of the proxy may ask of an inference engine.

``proxy.engines.sglang``, ``proxy.engines.vllm`` and the simulated engine each implement
:class:`Engine` in full; :mod:`proxy.engines.registry` maps a policy's engine name to one of them.
Callers hold an ``Engine`` and call its methods: nothing outside ``proxy/engines`` knows an engine's
flags, metric names, log formats or launcher.

Errors: methods that read what an engine wrote raise on a page or line they cannot read
(``MetricsParseError``) or return ``None`` where "nothing to report" is a normal answer (a log line
that says nothing); ``check_arg`` returns the problem in words, for the policy reader to place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from proxy.engines.base import AbortByName, Choice, Death, Knob, KnobName, LogEvent, Modelled, NativeRoute, Sample


class LogReader(Protocol):
    """Turns one worker's log lines into events; it may keep state across lines (a traceback)."""

    def feed(self, line: str, now: float) -> list[LogEvent]: ...

    def flush(self, now: float) -> list[LogEvent]: ...


class Engine(Protocol):
    """One inference engine, as the supervisor, the scraper, the controller and the policy see it."""

    @property
    def name(self) -> str:
        """The policy's name for it (``[engine] kind`` or, for external workers, ``speaks``)."""

    @property
    def ready_marker(self) -> str:
        """Text of the log line after which ``/health`` answers 200 (probed at once when it shows)."""

    @property
    def knobs(self) -> Mapping[KnobName, Knob]:
        """The arguments the controller may retune, behind engine-neutral names."""

    @property
    def runtime_args(self) -> frozenset[str]:
        """Arguments the running server lets a client change (no restart); every other one needs one."""

    def choice_args(self, choice: Choice, args: Mapping[str, object]) -> dict[str, object] | None:
        """The arguments that turn a person's ``choice`` on for a worker running ``args`` (suggested, never
        set); None: the engine has no such option, or ``args`` have it on already."""

    @property
    def loads_path(self) -> str | None:
        """A JSON load endpoint to read when ``/metrics`` is off (404); None: the engine has none."""

    def default_command(self) -> list[str]:
        """The launcher a worker's flags are appended to (the policy's ``engine.command`` overrides it)."""

    def required_args(self) -> tuple[str, ...]:
        """Arguments a managed worker cannot start without."""

    def check_arg(self, name: str, value: object) -> str | None:
        """The problem with one argument (name with underscores), or None when the engine takes it."""

    def check_extra_args(self, extra_args: Sequence[str]) -> str | None:
        """The problem with the policy's verbatim ``extra_args`` (a flag the supervisor sets), or None."""

    def build_argv(self, args: Mapping[str, object], extra_args: Sequence[str], *, host: str, port: int) -> list[str]:
        """The command-line flags of one worker."""

    def placement_args(self, gpus_per_worker: int, model: str | None) -> dict[str, object]:
        """The engine's own arguments for a worker given ``gpus_per_worker`` GPUs (tensor parallel;
        the supervisor sets ``CUDA_VISIBLE_DEVICES`` to exactly those) and serving ``model`` under
        that name (None: the engine's default name)."""

    @property
    def uses_host_gpus(self) -> bool:
        """Whether its workers compute on the host's GPUs, so that the GPU ids a pool names must be
        ones NVML sees there; False for the simulated engine, whose GPUs are modelled."""

    def modelled(self, args: Mapping[str, object], extra_args: Sequence[str]) -> Modelled:
        """The GPU and model presets a simulated engine's worker models, where its arguments or
        ``extra_args`` name them; none for an engine on the host's GPUs (NVML says what they are)."""

    def twin_args(self, args: Mapping[str, object]) -> dict[str, object] | None:
        """A worker's arguments as the planner's twin reads them (the simulated engine, an SGLang
        model, under the twin's own presets); None: the twin does not model this engine's workers."""

    @property
    def secret_args(self) -> frozenset[str]:
        """Arguments whose value is a secret (API keys): never shown in logs or summaries."""

    @property
    def model_args(self) -> frozenset[str]:
        """Arguments that say which model a worker serves (its weights, tokenizer, served name): a
        trial of other arguments on one worker of a pool must not change them."""

    def masked_argv(self, command: Sequence[str]) -> list[str]:
        """A worker's command line as logs may show it: :attr:`secret_args` values replaced by ``***``."""

    def prefix_affinity(self, args: Mapping[str, object]) -> bool:
        """Whether the worker's own scheduler groups requests by shared prefix, so the proxy should
        keep a prefix on one worker."""

    def prefix_queue_limit(self, args: Mapping[str, object]) -> int | None:
        """The waiting queue past which the worker's scheduler stops ordering it by shared prefix and
        serves it in arrival order (None: it never orders by prefix). The proxy's gate keeps the
        worker's queue on one side of it, not across it (:mod:`proxy.control.queue_side`)."""

    def priority_fields(self, args: Mapping[str, object], *, interactive: bool) -> Mapping[str, object]:
        """Fields to add to a request's body so the worker's own scheduler puts interactive requests
        before batch ones; empty when the worker's arguments do not turn priority scheduling on (an
        engine without it may refuse or ignore the field)."""

    @property
    def reserves_max_tokens(self) -> bool:
        """Whether the engine's admission reserves KV for what each request may still write (its
        ``max_tokens``), so that a smaller ``max_tokens`` lets it admit more at once; False where it
        allocates only as tokens are written and preempts when the pool runs out."""

    def admission_reserve(self, held: int, may_write: int, *, running: bool, ratio: float | None) -> int:
        """The KV tokens the engine's admission counts one request as taking: it holds ``held`` and may
        still write ``may_write`` (its ``max_tokens`` less what it wrote), ``running`` or still waiting
        to be admitted; ``ratio`` is the engine's live estimate of how much of that a running request
        writes (None: not exported). A new request is admitted where its own count fits beside the
        others' in the pool; an engine that reserves nothing counts what a request holds."""

    @property
    def abort_by_name(self) -> AbortByName | None:
        """How a running request sent under a name of the proxy's is aborted on a worker that keeps
        its connection open (a take-back that keeps what it wrote, a part of a request the client
        left); None: the engine has no such call, and a request ends when its connection closes."""

    @property
    def native_routes(self) -> tuple[NativeRoute, ...]:
        """The engine's own endpoints its clients call besides inference (SGLang's model and server
        info, ``/health_generate``, ``/flush_cache``, ``/abort_request``), served through the proxy."""

    def continuation_fields(
        self, path: str, body: Mapping[str, object], written_tokens: int
    ) -> dict[str, object] | None:
        """Fields that make a request on ``path`` continue an answer instead of starting one: the
        ``body`` already holds what was written (a chat's last message is the assistant's text so far,
        a completion's prompt ends with it), ``written_tokens`` of it. None: the engine cannot
        continue an answer on that route."""

    def parse_metrics(self, text: str, now: float) -> Sample:
        """One scrape of ``GET /metrics``."""

    def parse_loads(self, payload: Mapping[str, Any], now: float) -> Sample:
        """One read of :attr:`loads_path` (only called when it is not None)."""

    def log_reader(self) -> LogReader:
        """A reader for one worker's log (a new one per worker)."""

    def classify_death(self, tail: Sequence[str]) -> Death:
        """Why a worker died, from the last lines of its log (cause "unknown" when it does not say)."""

    @property
    def server_info_path(self) -> str | None:
        """Where the server reports the arguments it resolved; None: its start-up log says it all."""

    def running_limit(self, info: Mapping[str, Any]) -> int | None:
        """The most requests the worker runs at once, from the JSON at :attr:`server_info_path`; None
        where it does not say (the pacing then reads it from the worker's launch arguments or scrapes)."""

    def resolved_from_server_info(self, info: Mapping[str, Any]) -> dict[str, float]:
        """Values the engine chose for knobs left unset, from the JSON at :attr:`server_info_path`."""

    def server_info_disagrees(
        self, info: Mapping[str, Any], *, args: Mapping[str, object], port: int, launched: float
    ) -> str | None:
        """What in the JSON at :attr:`server_info_path` says the server is not the worker launched
        with ``args`` on ``port`` at ``launched`` (wall time), in words; None: it agrees (a worker
        left running by an earlier proxy is adopted only then)."""

    def clock_rate_from_server_info(self, info: Mapping[str, Any]) -> float | None:
        """How fast the worker's clock runs (engine seconds per wall second), from the JSON at
        :attr:`server_info_path`: a simulated worker's time scale; None where it does not say (a real
        engine, whose clock is the wall's). A managed worker's launch arguments say the same
        (:attr:`Modelled.clock_rate`); this reads an external one."""


def is_restart_needed(engine: Engine, knob: KnobName) -> bool:
    """Whether moving ``knob`` takes a restart of the worker on this engine."""
    return engine.knobs[knob].arg not in engine.runtime_args
