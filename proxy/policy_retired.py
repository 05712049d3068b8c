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
    }
)


def retired_message(dotted: str) -> str | None:
    """The refusal for a retired key, or None when ``dotted`` was never retired."""
    replaced_by = RETIRED_KEYS.get(dotted)
    if replaced_by is None:
        return None
    return f"this key was removed: {replaced_by}"
