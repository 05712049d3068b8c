"""Which engine module answers for a policy's ``[engine] kind``.

Each entry names the functions of one engine package; they are imported on first use so that a
proxy in front of SGLang never imports the vLLM module and vice versa. The simulated engine speaks
SGLang (same flags, metrics and logs), so ``sim`` and ``sglang`` share one package and differ only
in the command that launches a worker.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable

ENGINE_PACKAGES: dict[str, str] = {"sglang": "proxy.engines.sglang", "vllm": "proxy.engines.vllm"}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the rest of the proxy may ask of an engine, by kind."""

    kind: str  # the policy's kind: "sim", "sglang", "vllm"
    package: str  # the engine package that knows its names and formats

    def function(self, module: str, name: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(f"{self.package}.{module}"), name)

    def ready_marker(self) -> str | None:
        """Text of the log line the engine prints once it serves: the supervisor probes ``/health``
        as soon as it appears instead of at its next poll."""
        return getattr(importlib.import_module(f"{self.package}.logs"), "READY_MARKER", None)

    def default_command(self) -> list[str]:
        """The launcher a worker's flags are appended to (the policy's ``engine.command`` overrides it)."""
        if self.kind == "sim":
            return [sys.executable, "-m", "proxy", "sim"]
        if self.kind == "sglang":
            return ["python3", "-m", "sglang.launch_server"]
        if self.kind == "vllm":
            return ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        raise ValueError(f"no launcher for engine kind {self.kind!r}")


def engine_spec(kind: str) -> EngineSpec:
    """``kind`` is "sim", "sglang" or "vllm" (an external worker names the engine it speaks)."""
    package = ENGINE_PACKAGES["sglang" if kind == "sim" else kind] if kind in ("sim", *ENGINE_PACKAGES) else None
    if package is None:
        raise ValueError(f"unknown engine kind {kind!r}; expected sim, sglang or vllm")
    return EngineSpec(kind=kind, package=package)
