"""Fixtures shared across the test packages (each lives in :mod:`tests.harness`)."""

import signal

import pytest

from tests.real.prebuild import needs_engine

pytest_plugins = ["tests.harness.proxy", "tests.harness.postgres", "tests.harness.replays"]


def pytest_configure(config: pytest.Config) -> None:
    """Tests send Ctrl-C (SIGINT) to the processes they start and expect them to stop as they would at a
    terminal. A shell starts a background job with SIGINT ignored and every child inherits that (Python
    then never raises KeyboardInterrupt), so a suite run in the background would see those processes
    ignore the signal: the suite restores the default, and its children start as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One at a time (``make test``'s second part, or plain ``pytest``), the tests that need a real engine
    last: the environments they need build in the background meanwhile (tests/real/prebuild.py). Spread
    over cores (pytest-xdist: ``make test``'s first part, ``make test-fast``), the slow real-engine tests
    and the long end-to-end runs first: a run ends sooner when its longest tests start first than when
    one of them is left for the end. Each module keeps its own order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: 0 if item.get_closest_marker("slow") or item.get_closest_marker("long") else 1)
    else:
        items.sort(key=needs_engine)
