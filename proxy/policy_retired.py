"""Policy keys that no longer exist, each with what took its place.

A policy that still names one is refused (by ``pacer check-policy`` and ``pacer serve``) with a
message saying what replaced it, rather than a bare "unknown key". Entries are dotted keys as
written in a policy file ("control.window_s").
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
        "pacing.interactive_slot_headroom": "a constant: 1.25 running slots kept per interactive request open on "
        "a worker (proxy.request.pacing.INTERACTIVE_SLOT_HEADROOM)",
        "pacing.batch_prefill_tokens_beside_interactive": "derived from the worker: two prompt tokens per engine "
        "step per running slot of its running-request limit, the step read from its scrapes",
    }
)


def retired_message(dotted: str) -> str | None:
    """The refusal for a retired key, or None when ``dotted`` was never retired."""
    replaced_by = RETIRED_KEYS.get(dotted)
    if replaced_by is None:
        return None
    return f"this key was removed: {replaced_by}"
