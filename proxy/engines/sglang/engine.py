"""SGLang behind the engine contract (:class:`proxy.engines.contract.Engine`), and the simulated
engine, which speaks SGLang (same flags, endpoints, metrics and log lines) and differs only in its
launcher and in accepting its own ``sim_*`` arguments.

What can change without a restart: SGLang's ``POST /set_internal_state`` reaches the scheduler's
``set_internal_state``, whose allow-list is ``pp_max_micro_batch_size``,
``speculative_accept_threshold_single`` and ``speculative_accept_threshold_acc``; any other key logs
"Updating {k} is not supported." (``python/sglang/srt/managers/scheduler.py``, 0.5.x). So every knob
the controller moves (conservativeness, chunked prefill, max running requests, memory fraction)
takes a restart.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.engines.base import Death, Knob, KnobName, Sample
from proxy.engines.contract import LogReader
from proxy.engines.sglang import argv, knobs, logs, metrics

__all__ = ["SGLANG", "SIM", "SGLangEngine"]

RUNTIME_ARGS = frozenset(
    {"pp_max_micro_batch_size", "speculative_accept_threshold_single", "speculative_accept_threshold_acc"}
)


@dataclass(frozen=True, slots=True)
class SGLangEngine:
    """SGLang (``python -m sglang.launch_server``) or, with ``sim_args``, the simulated engine."""

    name: str
    command: tuple[str, ...]
    sim_args: bool = False  # accept the simulated engine's own ``sim_*`` arguments

    @property
    def ready_marker(self) -> str:
        return logs.READY_MARKER

    @property
    def knobs(self) -> Mapping[KnobName, Knob]:
        return knobs.KNOBS

    @property
    def runtime_args(self) -> frozenset[str]:
        return RUNTIME_ARGS

    @property
    def loads_path(self) -> str | None:
        return "/v1/loads"

    @property
    def server_info_path(self) -> str | None:
        return "/server_info"

    def default_command(self) -> list[str]:
        return list(self.command)

    def required_args(self) -> tuple[str, ...]:
        return () if self.sim_args else ("model_path",)

    def check_arg(self, name: str, value: object) -> str | None:
        return argv.check_arg(name, value, allow_sim=self.sim_args)

    def check_extra_args(self, extra_args: Sequence[str]) -> str | None:
        return argv.TABLE.check_extra_args(extra_args)

    def build_argv(self, args: Mapping[str, object], extra_args: Sequence[str], *, host: str, port: int) -> list[str]:
        return argv.build_argv(args, extra_args, host=host, port=port)

    def placement_args(self, gpus_per_worker: int, model: str | None) -> dict[str, object]:
        return argv.placement_args(gpus_per_worker, model)

    @property
    def secret_args(self) -> frozenset[str]:
        return argv.TABLE.secret

    def masked_argv(self, command: Sequence[str]) -> list[str]:
        return argv.TABLE.masked(command)

    def prefix_affinity(self, args: Mapping[str, object]) -> bool:
        return str(args.get("schedule_policy", "")) == "lpm"

    def parse_metrics(self, text: str, now: float) -> Sample:
        return metrics.parse_metrics(text, now)

    def parse_loads(self, payload: Mapping[str, Any], now: float) -> Sample:
        return metrics.parse_loads(dict(payload), now)

    def log_reader(self) -> LogReader:
        return logs.LogFollower()

    def classify_death(self, tail: Sequence[str]) -> Death:
        return logs.classify_death(tail)

    def resolved_from_server_info(self, info: Mapping[str, Any]) -> dict[str, float]:
        return knobs.resolved_from_server_info(info)


SGLANG = SGLangEngine(name="sglang", command=("python3", "-m", "sglang.launch_server"))
SIM = SGLangEngine(name="sim", command=(sys.executable, "-m", "proxy", "sim"), sim_args=True)
