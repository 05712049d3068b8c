"""Ctrl-C (or SIGTERM) on ``pacer serve`` while the controller restarts a worker: the proxy stops
within a bound and no worker process is left behind.

The real parts: ``pacer serve`` on the default policy (its controller timings shortened so it acts
within seconds), the simulated worker, ``pacer demo`` as the load that makes the controller act.
The worker runs under a small shell that outlives a SIGTERM by two seconds, the way an engine
takes its time to exit: the signal lands while the rollout waits for the old worker to stop.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the worker: the simulator under a shell that, SIGTERMed with its group, waits 2 s before it exits
_SLOW_EXIT = 'trap "sleep 2; exit 0" TERM; echo "$$" >> "$PIDS"; "$@" & echo "$!" >> "$PIDS"; wait "$!"'


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _policy(tmp_path: Path) -> Path:
    text = (ROOT / "policies" / "default.toml").read_text()
    sim = ", ".join(f'"{part}"' for part in (sys.executable, "-m", "proxy", "sim"))
    swaps = {
        'log_dir = ".pacer/logs"': f'log_dir = "{tmp_path / "logs"}"',
        '# journal_path = ".pacer/decisions.jsonl"': f'journal_path = "{tmp_path / "decisions.jsonl"}"',
        '# dir = ".pacer/batches"': f'dir = "{tmp_path / "batches"}"',
        'kind = "sim" ': f'command = ["sh", "-c", {_SLOW_EXIT!r}, "sh", {sim}]\nkind = "sim" ',
        "interval_s = 2.0 ": "interval_s = 0.5 ",
        "window_s = 20.0 ": "window_s = 4.0 ",
        "min_evidence_s = 8.0 ": "min_evidence_s = 3.0 ",
        "gpu_sample_interval_s = 5.0 ": "gpu_sample_interval_s = 0 ",
    }
    for old, new in swaps.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_controller_restart_stops_everything_promptly(tmp_path: Path, sig: signal.Signals) -> None:
    policy = _policy(tmp_path)
    pids = tmp_path / "worker-pids"
    env = dict(os.environ, PIDS=str(pids))
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--policy", str(policy), "--port", "0"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    demo = None
    try:
        deadline = time.monotonic() + 30
        url = None
        while time.monotonic() < deadline and not (url and "is ready" in log_path.read_text()):
            assert serve.poll() is None, log_path.read_text()[-2000:]
            if m := re.search(r"listening on (http://\S+?) ", log_path.read_text()):
                url = m.group(1)
            time.sleep(0.05)
        assert url, log_path.read_text()[-2000:]
        demo = subprocess.Popen(
            [sys.executable, "-m", "proxy", "demo", "--url", url, "--phases", "1", "--settle-s", "0",
             "--phase-s", "40", "--concurrency", "700"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 40
        while "restarting worker w0" not in log_path.read_text():
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.02)
        time.sleep(0.3)  # the old worker got its SIGTERM and takes 2 s to go
        stop_started = time.monotonic()
        serve.send_signal(sig)
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pacer serve still runs 20 s after {sig.name}: " + log_path.read_text()[-3000:])
        took = time.monotonic() - stop_started
    finally:
        for proc in (demo, serve):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()
        started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        left = [p for p in started if _alive(p)]
        for pid in left:  # none should be; a failing run must not leave them either
            os.killpg(pid, signal.SIGKILL) if pid in started[::2] else os.kill(pid, signal.SIGKILL)
    text = log_path.read_text()
    assert serve.returncode == 0, text[-3000:]
    assert took < 15, f"stopping took {took:.1f} s"
    assert "stopped" in text.splitlines()[-1]
    assert started and not left, f"worker processes left: {left} of {started}"
