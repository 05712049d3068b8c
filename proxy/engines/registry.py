"""The engines by the name a policy gives them (``[engine] kind``, or ``speaks`` for external workers).

A plain dict of :class:`proxy.engines.contract.Engine` implementations; :class:`EngineKind` is the
policy's vocabulary: an engine the proxy starts, or ``external`` for servers it only fronts.
"""

from __future__ import annotations

from enum import StrEnum

from proxy.engines.contract import Engine
from proxy.engines.sglang.engine import SGLANG, SIM
from proxy.engines.vllm.engine import VLLM

__all__ = ["ENGINES", "EngineKind", "engine_named"]

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (SIM, SGLANG, VLLM)}  # each kind but external


class EngineKind(StrEnum):
    """What the proxy starts as its workers; ``external``: servers it neither starts nor restarts."""

    SIM = "sim"  # the simulated SGLang engine (pacer sim)
    SGLANG = "sglang"
    VLLM = "vllm"
    EXTERNAL = "external"


def engine_named(name: str) -> Engine:
    """The engine a policy names; ValueError naming the known ones otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}") from None
