"""What each rule decided on: one frozen value per rule, written flat into the journal.

A decision carries its rule's evidence (``Decision.evidence``); the journal writes it as one JSON
object (``to_json``): the fields in order, the keys of a nested evidence in its place, and a field
marked :data:`OPTIONAL` left out when it is None (a figure the rule did not have, as opposed to one
it had and found empty). The knob a decision moves (``knob``, ``arg``, ``old_value``,
``new_value``) is not evidence but part of the decision (:class:`proxy.control.decision.KnobChange`);
the journal adds its keys to the same object.

| rule | evidence |
|---|---|
| ``prefill_oom``, ``decode_oom``, ``oom`` | :class:`PrefillOom`, :class:`DecodeOom`, :class:`UnplacedOom` |
| ``crash_loop`` | :class:`CrashLoop` |
| ``retraction_storm`` (an engine the planner does not model: vLLM) | :class:`BatchCapStorm` |
| ``kv_capacity`` | :class:`KvCapacity` |
| ``memory_low``, ``memory_headroom`` | :class:`MemoryBand` |
| ``pacing_too_timid`` | :class:`TimidPacing` |
| ``output_budget`` (the fast tier, no restart) | :class:`OutputBudget` |
| ``planner`` (the controller's twin) | :class:`Planned`, around :class:`PlanHorizon` (why its horizon) |
| ``hold_at_graphs`` (the planner's look, no restart) | :class:`HeldAtGraphs` |
| ``queue_side`` (the planner's look, no restart) | :class:`QueueSide` |
| a revival (the controller) | :class:`Death`, around the death rule's evidence if one chose the args |
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

__all__ = [
    "NO_EVIDENCE",
    "OPTIONAL",
    "ActivationFit",
    "BatchCapStorm",
    "CrashLoop",
    "Death",
    "DecodeOom",
    "Evidence",
    "GraphCover",
    "HeldAtGraphs",
    "JsonScalar",
    "KvCapacity",
    "MemoryBand",
    "OutputBudget",
    "PlanHorizon",
    "Planned",
    "PrefillOom",
    "QueueSide",
    "RequestFit",
    "Retractions",
    "TimidPacing",
    "UnplacedOom",
]

JsonScalar = float | int | str | bool | None
OPTIONAL = {"optional": True}  # field metadata: left out of the JSON when None


@dataclass(frozen=True, slots=True)
class Evidence:
    """The figures a rule decided on; subclasses name them (the base alone is "nothing to show")."""

    def to_json(self) -> dict[str, JsonScalar]:
        out: dict[str, JsonScalar] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Evidence):
                out.update(value.to_json())
            elif value is None and f.metadata.get("optional"):
                continue
            else:
                out[f.name] = value
        return out


NO_EVIDENCE = Evidence()


# -- out of memory and deaths ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillOom(Evidence):
    oom_phase: Literal["prefill"] = field(default="prefill", init=False)
    oom_cause: str  # what the engine's log blamed ("" when it did not say)
    log: str  # the OOM's first line


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeOom(Evidence):
    oom_phase: Literal["decode"] = field(default="decode", init=False)
    oom_cause: str
    peak_running: int | None  # the largest running batch in the window
    log: str
    peak_token_usage: float | None = field(default=None, metadata=OPTIONAL)  # the KV pool's largest usage in the window


@dataclass(frozen=True, slots=True, kw_only=True)
class UnplacedOom(Evidence):
    """Out of memory the log does not place in prefill or decode."""

    oom_phase: Literal["unknown"] = field(default="unknown", init=False)
    log: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashLoop(Evidence):
    deaths: int  # within window_s
    window_s: float
    fallback: Literal["last_good", "policy"]  # whose arguments it goes back to
    last_death: str | None = field(default=None, metadata=OPTIONAL)  # a loop they cannot break: its last cause


@dataclass(frozen=True, slots=True, kw_only=True)
class Death(Evidence):
    """A revival: why the worker died, how often lately, after the death rule's evidence (if any)."""

    rule: Evidence = NO_EVIDENCE
    death: str  # the cause in words
    deaths_in_window: int


# -- retractions ----------------------------------------------------------------------------------


# -- start-up memory and capacity -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Retractions(Evidence):
    """The retraction figures of a window and the thresholds they crossed."""

    retraction_rate_per_min: float
    threshold_per_min: float
    retractions_per_1k_tokens: float | None  # None: no throughput figure
    threshold_per_1k_tokens: float
    retractions: int
    observed_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFit(Evidence):
    """How many whole requests of the window's mean length fit the KV pool at once."""

    kv_capacity_tokens: int
    mean_request_tokens: float
    requests_that_fit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchCapStorm(Evidence):
    """A storm answered by capping the running batch (an engine without admission conservativeness)."""

    storm: Retractions
    running_when_kv_full: int
    fit: RequestFit | None = field(default=None, metadata=OPTIONAL)  # None: the cap is set below what ran instead


@dataclass(frozen=True, slots=True, kw_only=True)
class KvCapacity(Evidence):
    """The engine refused to start: the figures its refusal gave (each absent when it did not give it)."""

    log: str
    max_context: float | None = field(default=None, metadata=OPTIONAL)  # the longest request it was started for
    estimated_max_context: float | None = field(default=None, metadata=OPTIONAL)  # the longest its KV cache holds
    needed_gib: float | None = field(default=None, metadata=OPTIONAL)
    available_gib: float | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBand(Evidence):
    """Free device memory at start-up against the policy's band."""

    available_gpu_mem_gb: float
    band_gb: str  # "low-high"
    gpu_total_gb_at_least: float | None = field(default=None, metadata=OPTIONAL)  # memory_headroom's estimate


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationFit(Evidence):
    """The activations of a full prefill chunk or a full decode batch, as the twin's model of the
    worker gives them, against the free memory the worker reported at start-up."""

    available_gpu_mem_gb: float
    need_gb: float  # what the full chunk or batch needs
    tokens: int | None = field(default=None, metadata=OPTIONAL)  # the prefill chunk, in tokens
    batch: int | None = field(default=None, metadata=OPTIONAL)  # the decode batch, in requests
    graph_max_bs: int | None = field(default=None, metadata=OPTIONAL)  # batches up to this run in the CUDA graphs
    model: str  # whose activations: the twin's presets


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphCover(Evidence):
    """The decode batches the CUDA graphs cover against the KV pool they would take memory from, as the
    twin's model of the worker gives them, before its first launch."""

    graph_max_bs: int  # batches up to this run in the CUDA graphs now
    graph_mib: float  # the memory the raised graphs take (MiB)
    pool_mib: float  # the KV pool's memory (MiB)
    running_cap: int | None = field(default=None, metadata=OPTIONAL)  # the largest batch the engine runs
    available_gpu_mem_gb: float  # free at start-up, before the graphs are raised
    model: str  # whose figures: the twin's presets


# -- admission and pacing -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputBudget(Evidence):
    """The fast tier's output budget of one class on one worker: what its recent answers wrote."""

    request_class: str  # "interactive" or "batch"
    max_tokens: int  # what the requests it applies to ask for
    budget_tokens: int | None  # the max_tokens its plain requests now go with (None: as asked)
    applies_above_tokens: int | None  # ... those that ask for more than this (None: no budget)
    previous_tokens: int | None
    answers: int  # the answers it was read from
    high_tokens: int  # their high quantile (the budget is this x the margin, rounded up)
    quantile: float
    margin: float
    # lifted because answers reach it: those that did (in their first part), those that ended within it
    reached: int | None = None
    ended_within: int | None = None
    # the least max_tokens the previous budget applied to (None: there was none)
    previous_applies_above_tokens: int | None = field(default=None, metadata=OPTIONAL)

    @property
    def sent_before(self) -> int:
        """The ``max_tokens`` its requests went with before: the previous budget where it applied, else as asked."""
        above = self.previous_applies_above_tokens
        applied = self.previous_tokens is not None and (above is None or self.max_tokens >= above)
        return self.previous_tokens if applied and self.previous_tokens is not None else self.max_tokens

    @property
    def sent_now(self) -> int:
        """The ``max_tokens`` its requests go with now: the budget where it applies, else as asked."""
        above = self.applies_above_tokens
        applies = self.budget_tokens is not None and (above is None or self.max_tokens >= above)
        return self.budget_tokens if applies and self.budget_tokens is not None else self.max_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class TimidPacing(Evidence):
    queue_empty_fraction: float
    threshold_fraction: float


# -- the planner ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned(Evidence):
    """A plan of the calibrated twin: what it predicts for the new args and what the restart costs."""

    predicted_throughput: float  # output tokens/s the twin predicts under the new args
    predicted_current: float  # ... and under the current ones (same recent requests)
    measured_throughput: float | None  # what the worker did over the window
    predicted_queue_s: float | None
    gain_tokens: float  # (new - current) x the seconds it accrues over
    cost_tokens: float  # the restart's cost, measured on this worker
    horizon_s: float
    step_time_factor: float  # the twin's calibration: actual / expected step time
    kv_factor: float
    replayed_requests: int
    replays: int
    # what the restart is for: "throughput" or "waiting" (the same tokens answered sooner), and the
    # twin's mean time from arrival to answer under the new and the current args
    basis: str = "throughput"
    predicted_answer_s: float | None = None
    current_answer_s: float | None = None
    wait_saved_s: float = 0.0  # request-seconds over the horizon
    wait_cost_s: float = 0.0
    # the waiting basis: the work arriving over what the new args can do, that the restart's waiting was priced at
    utilization: float | None = field(default=None, metadata=OPTIONAL)
    # the seconds a throughput gain accrues over: the horizon, or less where the work waiting is expected
    # gone sooner (none waiting: 0)
    accrues_s: float | None = field(default=None, metadata=OPTIONAL)
    # the chosen arguments are the peers' (:mod:`proxy.control.peers`): their mean output rate, and the share
    # of this worker's window work waited for it (its rate is at least that share of its capacity)
    peers_rate: float | None = field(default=None, metadata=OPTIONAL)
    busy: float | None = field(default=None, metadata=OPTIONAL)
    # the proxy's own levers as this look priced them, each over the current args as they run: the
    # queue past lpm's limit over at it, and the worker held at its CUDA graphs over not held (tok/s)
    queue_past_over_at: float | None = field(default=None, metadata=OPTIONAL)
    held_over_current: float | None = field(default=None, metadata=OPTIONAL)
    horizon: Evidence = NO_EVIDENCE  # why ``horizon_s``: a :class:`PlanHorizon` (nothing: the configured one)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldAtGraphs(Evidence):
    """A look's price of holding the worker at its CUDA graphs' batch (:mod:`proxy.control.hold`)."""

    graph_batch: int  # the batch the graphs cover: the most requests held open (while the hold lasts)
    peak_running: int  # the largest batch the current args ran in the look's replay
    predicted_held_throughput: float  # output tokens/s the twin predicts held there
    predicted_current: float  # ... and not held
    held_answer_s: float | None  # the twin's mean time from arrival to answer, held and not
    current_answer_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSide(Evidence):
    """A look's price of the worker's queue at its engine's prefix limit and past it
    (:mod:`proxy.control.queue_side`)."""

    queue_at_limit: int  # the gate's queue at the limit (the engine orders it by prefix every round)
    queue_past_limit: int  # ... and past it (the engine serves it in arrival order)
    predicted_at_limit: float  # output tokens/s the twin predicts at the limit
    predicted_past_limit: float  # ... and past it
    at_limit_answer_s: float | None  # the twin's mean time from arrival to answer, at and past
    past_limit_answer_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanHorizon(Evidence):
    """Why a plan used its horizon (:func:`proxy.control.horizon.expected_horizon`): the traffic's word."""

    horizon_basis: str  # "configured" (the floor), "traffic" (the backlog's expected remainder) or "longest" (the cap)
    horizon_configured_s: float  # plan_horizon_s
    horizon_expected_s: float  # what the backlog said, before the bounds (0: no backlog)
    backlog_s: float  # seconds work had waited for the worker without a break
    waiting: float  # requests waiting at the latest look (the server's queue and its share of the proxy's)
    drain_s: float | None = field(default=None, metadata=OPTIONAL)  # the waiting at the answer rate
    # requests/s the work held (waiting + running) changed over the backlog's recent looks (<0: fell)
    backlog_trend: float | None = field(default=None, metadata=OPTIONAL)
    # the slowest fall those looks allow (two standard errors): what the horizon took (None: not falling)
    backlog_falling: float | None = field(default=None, metadata=OPTIONAL)
