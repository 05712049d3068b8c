"""vLLM's OpenAI server behind the engine contract (:class:`proxy.engines.contract.Engine`).

What can change without a restart: none of the arguments the controller moves. The scheduler's
``max_num_seqs`` and ``max_num_batched_tokens``, ``gpu_memory_utilization`` (it sizes the KV cache
at start-up) and ``max_model_len`` are fixed when the engine core starts (``vllm/v1/core/sched``,
``vllm/config``); the server's run-time endpoints (``/sleep``, ``/wake_up``,
``/reset_prefix_cache``) move weights and cache contents, not arguments.

Priority (:meth:`VllmEngine.priority_fields`): with ``scheduling_policy = "priority"`` vLLM takes a
request's ``priority`` field (default 0, lower values first, ties by arrival) and, when the KV cache
runs out, preempts the least important running request; without that policy it refuses a non-zero
priority (400), so the field is sent only when the policy is on: interactive 0, batch 100.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.engines.base import Choice, Death, Knob, KnobName, Modelled, NativeRoute, Sample
from proxy.engines.contract import LogReader
from proxy.engines.vllm import argv, knobs, logs, metrics

__all__ = ["VLLM", "VllmEngine"]

NO_FIELDS: Mapping[str, object] = MappingProxyType({})
INTERACTIVE_FIELDS: Mapping[str, object] = MappingProxyType({"priority": 0})
BATCH_FIELDS: Mapping[str, object] = MappingProxyType({"priority": 100})


_NATIVE = (NativeRoute(method="GET", path="/version"),)  # api_server.py: {"version": ...}


@dataclass(frozen=True, slots=True)
class VllmEngine:
    """vLLM (``python -m vllm.entrypoints.openai.api_server``)."""

    name: str = "vllm"
    command: tuple[str, ...] = ("python3", "-m", "vllm.entrypoints.openai.api_server")

    @property
    def ready_marker(self) -> str:
        return logs.READY_MARKER

    @property
    def knobs(self) -> Mapping[KnobName, Knob]:
        return knobs.KNOBS

    @property
    def runtime_args(self) -> frozenset[str]:
        return frozenset()

    def choice_args(self, choice: Choice, args: Mapping[str, object]) -> dict[str, object] | None:
        return knobs.choice_args(choice, args)

    @property
    def loads_path(self) -> str | None:
        return None  # no JSON load endpoint: /metrics is always on

    @property
    def server_info_path(self) -> str | None:
        return None  # the start-up log prints the values it resolved (KV size, max concurrency)

    def default_command(self) -> list[str]:
        return list(self.command)

    def required_args(self) -> tuple[str, ...]:
        return ()  # without --model the server loads its default model

    def check_arg(self, name: str, value: object) -> str | None:
        return argv.check_arg(name, value)

    def check_extra_args(self, extra_args: Sequence[str]) -> str | None:
        return argv.TABLE.check_extra_args(extra_args)

    def build_argv(self, args: Mapping[str, object], extra_args: Sequence[str], *, host: str, port: int) -> list[str]:
        return argv.build_argv(args, extra_args, host=host, port=port)

    def placement_args(self, gpus_per_worker: int, model: str | None) -> dict[str, object]:
        return argv.placement_args(gpus_per_worker, model)

    @property
    def secret_args(self) -> frozenset[str]:
        return argv.TABLE.secret

    @property
    def model_args(self) -> frozenset[str]:
        return argv.TABLE.identity

    def masked_argv(self, command: Sequence[str]) -> list[str]:
        return argv.TABLE.masked(command)

    def prefix_affinity(self, args: Mapping[str, object]) -> bool:
        return False  # the scheduler is FCFS (or priority): it does not group the queue by prefix

    def prefix_queue_limit(self, args: Mapping[str, object]) -> int | None:
        return None

    def priority_fields(self, args: Mapping[str, object], *, interactive: bool) -> Mapping[str, object]:
        if args.get("scheduling_policy") != "priority":
            return NO_FIELDS  # vLLM refuses a non-zero priority without the priority policy
        return INTERACTIVE_FIELDS if interactive else BATCH_FIELDS

    @property
    def uses_host_gpus(self) -> bool:
        return True

    def modelled(self, args: Mapping[str, object], extra_args: Sequence[str]) -> Modelled:
        return Modelled()

    def twin_args(self, args: Mapping[str, object]) -> dict[str, object] | None:
        return None  # the twin is an SGLang model: it does not plan a vLLM worker

    @property
    def reserves_max_tokens(self) -> bool:
        # the v1 scheduler allocates KV blocks for the tokens a step computes and preempts the newest
        # request when the pool runs out: max_tokens reserves nothing
        return False

    def admission_reserve(self, held: int, may_write: int, *, running: bool, ratio: float | None) -> int:
        return held  # blocks for the tokens computed, none for what a request may write

    @property
    def abort_by_name(self) -> None:
        # no /abort_request: a request ends when its connection closes, and its answer with it
        return None

    @property
    def native_routes(self) -> tuple[NativeRoute, ...]:
        return _NATIVE

    def continuation_fields(
        self, path: str, body: Mapping[str, object], written_tokens: int
    ) -> dict[str, object] | None:
        if path == "/v1/chat/completions":
            # ChatCompletionRequest: both flags, or it refuses ("Cannot set both ... to True"). The
            # text goes through the template and is tokenized with it: a template that trims
            # messages (Llama-3's) loses its leading and trailing whitespace (docs/real-engines.md)
            return {"continue_final_message": True, "add_generation_prompt": False}
        if path == "/v1/completions":
            return {}
        return None

    def parse_metrics(self, text: str, now: float) -> Sample:
        return metrics.parse_metrics(text, now)

    def parse_loads(self, payload: Mapping[str, Any], now: float) -> Sample:
        raise NotImplementedError("vLLM has no JSON load endpoint (loads_path is None)")

    def log_reader(self) -> LogReader:
        return logs.LogFollower()

    def classify_death(self, tail: Sequence[str]) -> Death:
        return logs.classify_death(tail)

    def running_limit(self, info: Mapping[str, Any]) -> int | None:
        return None  # no server info (its max_num_seqs is known only where the policy sets it)

    def resolved_from_server_info(self, info: Mapping[str, Any]) -> dict[str, float]:
        return {}  # server_info_path is None: never asked

    def server_info_disagrees(
        self, info: Mapping[str, Any], *, args: Mapping[str, object], port: int, launched: float
    ) -> str | None:
        return None  # server_info_path is None: never asked

    def clock_rate_from_server_info(self, info: Mapping[str, Any]) -> float | None:
        return None  # server_info_path is None: never asked (a real engine's clock is the wall's)


VLLM = VllmEngine()
