"""The project's own lint checks, run by ``make lint`` (``python -m tools.NAME``)."""
