"""Live signals: the one scraper of the workers' load (``scraper``, feeding pacing and control)
and the GPU memory sampler (``nvml``)."""
