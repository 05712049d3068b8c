"""The controller's constants: every duration, threshold and step that is not the operator's to set.

Durations are in the engine's seconds: what they mean is a span of the worker's own work (a window
of its answers, a restart's worth of evidence), so a simulated worker that runs ten times faster than
a GPU needs them ten times shorter on the wall clock. :meth:`Constants.in_wall` converts them with the
worker's clock rate (engine seconds per wall second: a simulator's time scale, 1 for a real engine);
rates per minute go the other way. The values are the ones the scenarios are measured with.

Tests that need a short timing pass their own (``dataclasses.replace(CONSTANTS, window_s=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

from proxy.engines.base import KnobName

__all__ = ["CONSTANTS", "DEFAULT_BOUNDS", "Constants"]

# the range each knob may move in when the policy's control.bounds does not name its argument: the
# low ends keep a worker serving (SGLang's own floor of conservativeness is 0; below 0.1 a pool of
# long answers retracts on every step), the high ends leave room for the engine's other buffers
DEFAULT_BOUNDS: Mapping[KnobName, tuple[float, float]] = MappingProxyType(
    {
        KnobName.CONSERVATIVENESS: (0.1, 2.0),
        KnobName.MEMORY_FRACTION: (0.5, 0.95),
        KnobName.MAX_RUNNING: (8, math.inf),  # a batch of 8 still fills a GPU's decode step
        KnobName.PREFILL_CHUNK: (2048, math.inf),  # smaller chunks spend more on each prefill's weights
    }
)

_DURATIONS = frozenset(
    {
        "interval_s", "window_s", "min_evidence_s", "cooldown_s", "flip_guard_s", "good_after_s",
        "crash_loop_window_s", "drain_timeout_s", "drain_settle_s", "backoff_hold_s", "rate_window_s",
        "facts_window_s", "plan_interval_s", "plan_horizon_s", "plan_horizon_max_s", "plan_trend_s",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Constants:
    """What the controller holds fixed; durations in the engine's seconds (see the module's words)."""

    # -- rhythm: how often it looks, over how much
    interval_s: float = 5.0  # between ticks: a few scrapes, far below any restart's cost
    window_s: float = 60.0  # a rule's and an outcome's look-back: a minute holds hundreds of answers
    min_evidence_s: float = 20.0  # served this long since a (re)start before anything is judged on it
    # -- restraint
    cooldown_s: float = 60.0  # after a restart its worker is left alone: its first window refills the batch
    flip_guard_s: float = 1800.0  # a knob moved one way is not moved back by a tuning rule within this
    good_after_s: float = 120.0  # arguments that ran this long without a crash become the crash-loop fallback
    crash_loop: int = 3  # deaths within crash_loop_window_s that make a crash loop
    crash_loop_window_s: float = 600.0  # ten minutes: a worker that dies 3 times in it is not unlucky
    crash_backoff_s: tuple[float, ...] = (2.0, 5.0, 15.0, 30.0, 60.0)  # before a revival, per death in a row
    # longest drain before a restart (it ends sooner once its requests stop finishing: the rollout's slices);
    # what is still running then is taken back and goes on from what it wrote
    drain_timeout_s: float = 30.0
    # a stream that already sent output cannot be taken back: past the drain's deadline a restart still
    # waits this long for such streams to end (an answer's tail), then restarts the worker all the same
    drain_settle_s: float = 10.0
    # -- the fast tier (no restart)
    backoff_hold_s: float = 5.0  # the admission limit backs off at most once per this, grows 1/16 per this
    rate_window_s: float = 30.0  # smoothing of the retraction and output-token rates
    facts_window_s: float = 60.0  # answers a worker's facts are read over (prompt, output, first token)
    # -- what counts as a sign
    retractions_per_min: float = 6.0  # per engine minute: below it a retraction rate is noise
    retractions_per_1k_tokens: float = 0.5  # retracted requests per 1,000 output tokens: admission over-commits
    low_usage: float = 0.9  # token usage at or above this: the KV pool is full (the backlog's "full" mark)
    timid_queue_fraction: float = 0.5  # server queue empty this often while the proxy holds work: a note
    decode_oom_factor: float = 0.8  # a decode OOM caps the running batch at the peak seen x this
    # a decode OOM with the KV pool at most this full gives the activations pool memory instead: a
    # quarter more free memory is a few % of the pool, which cannot make a half-empty pool bind
    spare_pool_usage: float = 0.5
    available_mem_band_gb: tuple[float, float] = (5.0, 10.0)  # free memory at start-up outside it moves the fraction
    memory_fraction_step: float = 0.01  # one step of the memory fraction (about 0.8 GB on an 80 GB GPU)
    # -- the planner
    plan_interval_s: float = 60.0  # between plans of one worker: a plan replays a few hundred answers
    plan_horizon_s: float = 600.0  # how long traffic just seen is expected to last when it says no more
    plan_horizon_max_s: float = 3600.0  # the longest horizon a standing backlog can earn
    plan_trend_s: float = 240.0  # looks a backlog's trend is read over
    plan_min_gain: float = 0.03  # a predicted gain below this is inside the twin's error: never a restart
    plan_requests: int = 300  # newest answers a plan replays (and an acted plan is checked on)
    plan_confirmations: int = 2  # plans in a row that must say a restart pays: one is chance
    canary_margin: float = 0.03  # a canary is promoted when it beats the others by this
    canary_fail_below: float = 0.5  # a canary under half its share before is reverted without waiting
    # the twin of a worker on a GPU the simulator does not name (a real one): these presets until its own
    # decode lines calibrate the step time and its start-up line the KV pool (the planner's calibrate)
    twin_gpu: str = "h100-80gb"
    twin_model: str = "llama-3.1-8b"
    bounds: Mapping[KnobName, tuple[float, float]] = field(default_factory=lambda: DEFAULT_BOUNDS)

    def in_wall(self, clock_rate: float) -> Constants:
        """These constants on the wall clock of a worker whose clock runs ``clock_rate`` engine seconds
        per wall second: durations divided by it, rates per minute multiplied."""
        if not clock_rate > 0:
            raise ValueError(f"clock rate must be > 0, got {clock_rate!r}")
        if clock_rate == 1.0:
            return self
        changed: dict[str, object] = {}
        for f in fields(self):
            if f.name in _DURATIONS:
                changed[f.name] = getattr(self, f.name) / clock_rate
        changed["crash_backoff_s"] = tuple(s / clock_rate for s in self.crash_backoff_s)
        changed["retractions_per_min"] = self.retractions_per_min * clock_rate
        return replace(self, **changed)  # type: ignore[arg-type]


CONSTANTS = Constants()
