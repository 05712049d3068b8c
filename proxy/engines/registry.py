"""The engines by the name a policy gives them (``[engine] kind``, or ``speaks`` for external workers).

A plain dict of :class:`proxy.engines.contract.Engine` implementations; :class:`EngineKind` is the
policy's vocabulary: an engine the proxy starts, or ``external`` for servers it only fronts.
:data:`SPOKEN_BY_DEFAULT` is what external workers speak when the policy does not say, and
:func:`example_arg` names a knob's argument for the policy's help and messages, so that neither
names an engine's flag outside this package.
"""

from __future__ import annotations

from enum import StrEnum

from proxy.engines.base import KnobName
from proxy.engines.contract import Engine
from proxy.engines.sglang.engine import SGLANG, SIM
from proxy.engines.vllm.engine import VLLM

__all__ = ["ENGINES", "SPOKEN_BY_DEFAULT", "EngineKind", "engine_named", "example_arg"]

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (SIM, SGLANG, VLLM)}  # each kind but external


class EngineKind(StrEnum):
    """What the proxy starts as its workers; ``external``: servers it neither starts nor restarts."""

    SIM = "sim"  # the simulated SGLang engine (pacer sim)
    SGLANG = "sglang"
    VLLM = "vllm"
    EXTERNAL = "external"


# the policy's default ``speaks``: what external workers speak unless it says otherwise
SPOKEN_BY_DEFAULT = EngineKind.SGLANG


def engine_named(name: str) -> Engine:
    """The engine a policy names; ValueError naming the known ones otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}") from None


def example_arg(knob: KnobName, kind: str = EngineKind.SIM) -> str:
    """The argument that moves ``knob`` on the engine of ``kind`` (by default the policy's default
    kind's), for an example in the policy's help or an error message; ``kind`` ``external`` or one
    without the knob: the default kind's."""
    engine = ENGINES.get(kind)
    if engine is None or knob not in engine.knobs:
        engine = ENGINES[EngineKind.SIM]
    return engine.knobs[knob].arg
