"""How ``pacer serve`` starts and stops, as a real process on real sockets in front of the simulated
worker.

- A port in use: the proxy says so and exits before any worker launches, without a traceback.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

POLICY = """\
[proxy]
gpu_sample_interval_s = 0

[engine]
kind = "sim"
workers = 1
extra_args = ["--sim-time-scale", "10", "--sim-startup-seconds", "0"]

[control]
mode = "off"
"""


@contextlib.contextmanager
def serving(folder: Path, port: int = 0) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``pacer serve`` on ``folder/policy.toml`` (its state and worker logs under ``folder``); killed
    if it still runs when the block ends."""
    (folder / "policy.toml").write_text(POLICY)
    log_path = folder / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--policy", "policy.toml", "--port", str(port)],
            cwd=folder, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(60)
def test_a_port_in_use_stops_before_any_worker_launches(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serving(tmp_path, port=port) as (proc, log):
            code = proc.wait(30)
    text = log.read_text()
    assert code == 1, text[-3000:]
    lines = text.splitlines()
    assert lines[-1].endswith(f"cannot listen on 127.0.0.1:{port}: address already in use"), text[-3000:]
    assert "Traceback" not in text and "Error" not in text, text[-3000:]
    assert "worker w0" not in text and not (tmp_path / ".pacer").exists(), "a worker was launched: " + text[-3000:]
