"""Live signals: the one scraper of the workers' load (``scraper``, feeding pacing and control)
and the GPU memory sampler (``nvml``).

Errors: an observer never raises to its caller and its loop never dies. What it could not read is
part of what it reports: a failed scrape is published on the load board as the worker's error (its
sample goes stale), a GPU that cannot be read is a report whose ``reason`` says why (a field NVML
cannot give is ``None``).
"""
