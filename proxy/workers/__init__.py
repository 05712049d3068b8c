"""Engine worker processes: the pool seam (``base``), one process (``process``), the supervisor."""
