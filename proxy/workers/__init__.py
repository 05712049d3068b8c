"""Engine worker processes: the pool seam (``base``), one process (``process``), the supervisor.

Errors: what happens to a worker is its state, not an exception: a worker that cannot start, dies
or stops answering is DOWN with ``last_error`` and ``exit_code`` saying why, and listeners hear
of it. ``WorkerError`` is raised only for a request the pool refuses (an unknown worker, a
restart of an external one, a transition its state does not allow).
"""
