"""SGLang behind the engine contract (:class:`proxy.engines.contract.Engine`), and the simulated
engine, which speaks SGLang (same flags, endpoints, metrics and log lines) and differs only in its
launcher and in accepting its own ``sim_*`` arguments.

What can change without a restart: SGLang's ``POST /set_internal_state`` reaches the scheduler's
``set_internal_state``, whose allow-list is ``pp_max_micro_batch_size``,
``speculative_accept_threshold_single`` and ``speculative_accept_threshold_acc``; any other key logs
"Updating {k} is not supported." (``python/sglang/srt/managers/scheduler.py``, 0.5.x). So every knob
the controller moves (conservativeness, chunked prefill, max running requests, memory fraction)
takes a restart.

Priority (:meth:`SGLangEngine.priority_fields`): with ``enable_priority_scheduling`` SGLang orders
its waiting queue by each request's ``priority`` field (higher values first, lower with
``schedule_low_priority_values_first``; a request without one is the least important) and, unless
``disable_priority_preemption``, a request more than ``priority_scheduling_preemption_threshold``
(10) above a running one preempts it when the batch is full. The proxy sends interactive requests at
:data:`INTERACTIVE_PRIORITY` and batch ones at :data:`BATCH_PRIORITY` (reversed signs with low values
first): a gap of 100, so interactive work preempts batch work at the default threshold and an
operator who wants no preemption says so with SGLang's own flags. Without the flag the field is not
sent (SGLang ignores it, or answers 503 with ``abort_on_priority_when_disabled``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from proxy.engines.base import AbortByName, Choice, Death, Knob, KnobName, Modelled, NativeRoute, Sample
from proxy.engines.contract import LogReader
from proxy.engines.sglang import argv, knobs, logs, metrics

__all__ = ["BATCH_PRIORITY", "INTERACTIVE_PRIORITY", "SGLANG", "SIM", "SGLangEngine"]

INTERACTIVE_PRIORITY = 100
BATCH_PRIORITY = 0
NO_FIELDS: Mapping[str, object] = MappingProxyType({})
# a request's ``rid`` (GenerateReqInput, and ChatCompletionRequest / CompletionRequest's ``rid``, 0.5.x)
# names it for POST /abort_request (AbortReq ``{"rid": ...}``); a graceful abort (no message:
# FINISH_ABORT() without a status code) of a running whole request ends it at its next step and answers
# it normally, with the text written so far and finish_reason "abort"
# (tokenizer_manager._handle_abort_finish_reason)
# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION and SGLANG_INIT_NEW_TOKEN_RATIO (srt/environ.py, 0.5.x): the
# most of max_new_tokens admission counts, and the ratio a scheduler starts from (x conservativeness)
_CLIP_MAX_NEW_TOKENS = 4096
_INIT_NEW_TOKEN_RATIO = 0.7
_ABORT_BY_RID = AbortByName(field="rid", path="/abort_request", answers_with_output=True)
# http_server.py (0.5.x): the info its clients read at start (the frontend's RuntimeEndpoint reads
# /get_model_info), the deep health check (a one-token generate), and what acts on every worker (the
# router sends /flush_cache to each; a rid is aborted wherever it runs); the /get_* names are the
# deprecated aliases, still served
_NATIVE = (
    *(
        NativeRoute(method="GET", path=p)
        for p in ("/model_info", "/get_model_info", "/server_info", "/get_server_info")
    ),
    NativeRoute(method="GET", path="/health_generate"),
    NativeRoute(method="GET", path="/flush_cache", every_worker=True, operator=True),
    NativeRoute(method="POST", path="/flush_cache", every_worker=True, operator=True),
    # a rid, or abort_all: another caller's requests too
    NativeRoute(method="POST", path="/abort_request", every_worker=True, operator=True),
)
_PRIORITY: Mapping[tuple[bool, bool], Mapping[str, object]] = {  # (interactive, low values first)
    (True, False): MappingProxyType({"priority": INTERACTIVE_PRIORITY}),
    (False, False): MappingProxyType({"priority": BATCH_PRIORITY}),
    (True, True): MappingProxyType({"priority": BATCH_PRIORITY}),
    (False, True): MappingProxyType({"priority": INTERACTIVE_PRIORITY}),
}

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

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

    def choice_args(self, choice: Choice, args: Mapping[str, object]) -> dict[str, object] | None:
        return knobs.choice_args(choice, args)

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

    @property
    def model_args(self) -> frozenset[str]:
        return argv.TABLE.identity

    def masked_argv(self, command: Sequence[str]) -> list[str]:
        return argv.TABLE.masked(command)

    def prefix_affinity(self, args: Mapping[str, object]) -> bool:
        return str(args.get("schedule_policy", "")) == "lpm"

    def prefix_queue_limit(self, args: Mapping[str, object]) -> int | None:
        return argv.LPM_QUEUE_LIMIT if self.prefix_affinity(args) else None

    def priority_fields(self, args: Mapping[str, object], *, interactive: bool) -> Mapping[str, object]:
        if not args.get("enable_priority_scheduling"):
            return NO_FIELDS
        low_first = bool(args.get("schedule_low_priority_values_first"))
        return _PRIORITY[(interactive, low_first)]

    @property
    def uses_host_gpus(self) -> bool:
        return not self.sim_args  # the simulator models its GPU: CUDA_VISIBLE_DEVICES is only a label there

    def modelled(self, args: Mapping[str, object], extra_args: Sequence[str]) -> Modelled:
        if not self.sim_args:
            return Modelled()
        # extra_args come after the args' flags: where both name one, the simulator runs the last
        flags = argv.parse_argv_args(extra_args)
        gpu, model, scale = (flags.get(name) or args.get(name) for name in ("sim_gpu", "sim_model", "sim_time_scale"))
        rate = _positive(scale) or 1.0
        return Modelled(gpu=str(gpu) if gpu else None, model=str(model) if model else None, clock_rate=rate)

    def twin_args(self, args: Mapping[str, object]) -> dict[str, object] | None:
        # the twin runs its own presets: a simulated worker's hidden factors (its sim_* arguments) are not read
        out = {k: v for k, v in args.items() if not k.startswith("sim_") and v is not None}
        arg = knobs.KNOBS[KnobName.CONSERVATIVENESS].arg
        value = out.get(arg)
        if isinstance(value, int | float):
            out[arg] = float(value)
        return out

    @property
    def reserves_max_tokens(self) -> bool:
        # PrefillAdder: a new request reserves min(max_new_tokens, 4096) of KV, a running one its
        # remaining max_new_tokens x new_token_ratio (managers/schedule_policy.py)
        return True

    def admission_reserve(self, held: int, may_write: int, *, running: bool, ratio: float | None) -> int:
        # PrefillAdder: rem_total_tokens is the free and evictable KV less, per running request,
        # min(max_new_tokens - written, CLIP) x new_token_ratio (1 with ignore_eos); a new request fits
        # where its prompt and min(max_new_tokens, CLIP) do (managers/schedule_policy.py)
        left = min(max(0, may_write), _CLIP_MAX_NEW_TOKENS)
        if not running:
            return held + left
        return held + math.ceil(left * (_INIT_NEW_TOKEN_RATIO if ratio is None else ratio))

    @property
    def abort_by_name(self) -> AbortByName:
        return _ABORT_BY_RID

    @property
    def native_routes(self) -> tuple[NativeRoute, ...]:
        return _NATIVE

    def continuation_fields(
        self, path: str, body: Mapping[str, object], written_tokens: int
    ) -> dict[str, object] | None:
        fields: dict[str, object]
        if path == CHAT_PATH:
            # ChatCompletionRequest.continue_final_message (0.5.x): the last assistant message is
            # taken out of the template and its text appended to the prompt, open (serving_chat.py)
            fields = {"continue_final_message": True}
        elif path == COMPLETIONS_PATH:
            fields = {}  # the prompt already ends with the text written
        else:
            return None
        if self.sim_args and isinstance(out := body.get("sim_output_len"), int) and not isinstance(out, bool):
            fields["sim_output_len"] = max(1, out - written_tokens)  # the simulator's true length, what is left of it
        return fields

    def parse_metrics(self, text: str, now: float) -> Sample:
        return metrics.parse_metrics(text, now)

    def parse_loads(self, payload: Mapping[str, Any], now: float) -> Sample:
        return metrics.parse_loads(dict(payload), now)

    def log_reader(self) -> LogReader:
        return logs.LogFollower()

    def classify_death(self, tail: Sequence[str]) -> Death:
        return logs.classify_death(tail)

    def running_limit(self, info: Mapping[str, Any]) -> int | None:
        return knobs.running_limit(info)

    def resolved_from_server_info(self, info: Mapping[str, Any]) -> dict[str, float]:
        return knobs.resolved_from_server_info(info)

    def server_info_disagrees(
        self, info: Mapping[str, Any], *, args: Mapping[str, object], port: int, launched: float
    ) -> str | None:
        return knobs.server_info_disagrees(info, args=args, port=port, launched=launched)

    def clock_rate_from_server_info(self, info: Mapping[str, Any]) -> float | None:
        # the simulator reports its time scale among its internal states and its own arguments; SGLang
        # itself has neither (its clock is the wall's)
        states = info.get("internal_states")
        sim = states[0].get("sim") if isinstance(states, list) and states and isinstance(states[0], dict) else None
        scale = sim.get("time_scale") if isinstance(sim, dict) else info.get("sim_time_scale")
        return _positive(scale)


def _positive(value: object) -> float | None:
    """A number > 0 (a flag's text or a JSON number), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


SGLANG = SGLangEngine(name="sglang", command=("python3", "-m", "sglang.launch_server"))
SIM = SGLangEngine(name="sim", command=(sys.executable, "-m", "proxy", "sim"), sim_args=True)
