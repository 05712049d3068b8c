"""Fixtures shared across the test packages (each lives in :mod:`tests.harness`)."""

pytest_plugins = ["tests.harness.proxy"]
