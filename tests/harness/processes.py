"""Whether a process a test started is still there."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """``pid`` names a process (a zombie not yet reaped by its parent counts as one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
