"""Policy keys that no longer exist, each with what took its place.

A policy that still names one is refused (by ``pacer check-policy`` and ``pacer serve``) with a
message saying what replaced it, rather than a bare "unknown key". Entries are dotted keys as
written in a policy file ("control.window_s"); a pool's own table of the same name retires them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["RETIRED_KEYS", "retired_message"]

RETIRED_KEYS: Mapping[str, str] = MappingProxyType(
    {
        # "section.key": "what replaced it (one short sentence)",
        "pacing.batch_queue_beside_interactive": "beside interactive work the batch keeps one request waiting in "
        "a worker's queue, always (proxy.request.pacing.BATCH_QUEUE_BESIDE_INTERACTIVE)",
        "pacing.batch_in_flight_beside_interactive": "derived from the worker: its running-request limit (server "
        "info, launch arguments or scrapes) less a sixteenth",
        "pacing.interactive_window_s": "a constant: 5 s of the engine's clock, on each pool's workers' clock "
        "(proxy.request.pacing.INTERACTIVE_WINDOW_S)",
        "pacing.interactive_slot_headroom": "a constant: 1.25 running slots kept per interactive request open on "
        "a worker (proxy.request.pacing.INTERACTIVE_SLOT_HEADROOM)",
        "pacing.batch_prefill_tokens_beside_interactive": "derived from the worker: two prompt tokens per engine "
        "step per running slot of its running-request limit, the step read from its scrapes",
        "control.interval_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.window_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.min_evidence_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.cooldown_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.flip_guard_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.good_after_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.crash_loop_window_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.crash_backoff_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.backoff_hold_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.rate_window_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.facts_window_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.plan_interval_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.plan_horizon_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.plan_horizon_max_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.plan_trend_s": "a constant of the controller, in the engine's seconds (docs/controller.md)",
        "control.drain_timeout_s": "a constant of the controller, in the engine's seconds; a drain also ends once its requests stop finishing (docs/controller.md)",
        "control.retractions_per_min": "a constant of the controller, per minute of the engine's clock (docs/controller.md)",
        "control.crash_loop": "a constant of the controller (docs/controller.md)",
        "control.retractions_per_1k_tokens": "a constant of the controller (docs/controller.md)",
        "control.low_usage": "a constant of the controller (docs/controller.md)",
        "control.timid_queue_fraction": "a constant of the controller (docs/controller.md)",
        "control.decode_oom_factor": "a constant of the controller (docs/controller.md)",
        "control.available_mem_band_gb": "a constant of the controller (docs/controller.md)",
        "control.memory_fraction_step": "a constant of the controller (docs/controller.md)",
        "control.plan_min_gain": "a constant of the controller (docs/controller.md)",
        "control.plan_requests": "a constant of the controller (docs/controller.md)",
        "control.plan_confirmations": "a constant of the controller (docs/controller.md)",
        "control.canary_margin": "a constant of the controller (docs/controller.md)",
        "control.canary_fail_below": "a constant of the controller (docs/controller.md)",
        "control.low_usage_fraction": "its rule's tuning restarts are the planner's now (docs/controller.md)",
        "control.admission_min_gain": "its rule's tuning restarts are the planner's now (docs/controller.md)",
        "control.conservativeness_step": "its rule's tuning restarts are the planner's now (docs/controller.md)",
        "control.conservativeness_bounds": "control.bounds, a range keyed by the engine's own argument name (docs/controller.md)",
        "control.memory_fraction_bounds": "control.bounds, a range keyed by the engine's own argument name (docs/controller.md)",
        "control.max_running_min": "control.bounds, a range keyed by the engine's own argument name (docs/controller.md)",
        "control.prefill_chunk_min": "control.bounds, a range keyed by the engine's own argument name (docs/controller.md)",
        "control.planner": "the planner is always on (the rules keep only safety)",
        "control.launch_forecast": "always on with the planner",
        "control.twin_gpu": "a simulated worker's twin uses its own presets, a real GPU's calibrates from the worker's own lines",
        "control.twin_model": "a simulated worker's twin uses its own presets, a real GPU's calibrates from the worker's own lines",
        "store.claim_s": "a constant: a batch line's claim lasts 14 s, renewed every third of that "
        "(proxy.batch.runner.CLAIM_S, docs/fleet.md)",
        "store.poll_s": "constants: a replica looks at the store every second for the leader lease and roster, "
        "batches and cancels, and decisions (POLL_S in proxy.workers.replicas, proxy.batch.runner, "
        "proxy.control.shared_journal)",
        "store.leader_lease_s": "a constant: the leader's lease lasts 10 s, so a new leader takes over within "
        "15 s of the old one's death (proxy.workers.replicas.LEADER_LEASE_S, docs/fleet.md)",
    }
)


def retired_message(dotted: str) -> str | None:
    """The refusal for a retired key, or None when ``dotted`` was never retired."""
    # a [[pool]]'s own table ("pool[big].control.window_s") retires what its top-level one does
    replaced_by = RETIRED_KEYS.get(dotted) or RETIRED_KEYS.get(".".join(dotted.split(".")[-2:]))
    if replaced_by is None:
        return None
    return f"this key was removed: {replaced_by}"
