"""A real ``pacer serve`` process for end-to-end tests: started on a free port in a folder that holds
its ``policy.toml``, its output in ``pacer.log`` there, and stopped (SIGTERM, then SIGKILL past the
grace) when the block ends, whatever the test did."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from proxy.workers.supervisor import free_port

__all__ = ["pacer_serve"]


@contextlib.contextmanager
def pacer_serve(folder: Path, grace_s: float = 30.0) -> Iterator[tuple[str, Path]]:
    """Run ``pacer serve --policy policy.toml`` in ``folder``; yields its URL and its log's path."""
    port = free_port("127.0.0.1")
    log_path = folder / "pacer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--policy", "policy.toml", "--port", str(port)],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}", log_path
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
