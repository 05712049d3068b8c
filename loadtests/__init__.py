"""Benchmarks and scenarios: ``python -m loadtests NAME [options]``."""
