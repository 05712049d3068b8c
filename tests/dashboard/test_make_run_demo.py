"""``make run`` and ``pacer demo``, as a newcomer runs them: the default policy (its paths and port
moved into the test's directory) starts the proxy and a simulated worker, the demo's first phase
makes the controller act within a minute (the fast tier's output budget, no restart: a restart under
load is ``tests/control/test_stop_during_restart.py``'s), the dashboard's timeline and ``pacer
decisions`` show that decision with its evidence, its predicted gain and its measured one (the
budget held back a while to measure it), and the planner's view of the same load with its
predicted gain, and an interrupt stops the proxy and its worker within bounded time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from proxy.control.fast_tier import PaceSettings
from tests.harness.processes import pid_alive
from tests.harness.wait import wait_until_blocking

pytestmark = [pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def admin(url: str, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=5) as r:
        return orjson.loads(r.read())


@pytest.mark.timeout(240)
def test_make_run_then_the_demo_makes_the_controller_act(tmp_path: Path) -> None:
    text = (ROOT / "policies" / "default.toml").read_text()
    text = text.replace('log_dir = ".pacer/logs"', f'log_dir = "{tmp_path / "logs"}"')
    text = text.replace('# journal_path = ".pacer/decisions.jsonl"', f'journal_path = "{tmp_path / "decisions.jsonl"}"')
    text = text.replace('# dir = ".pacer/batches"', f'dir = "{tmp_path / "batches"}"')
    assert str(tmp_path / "decisions.jsonl") in text and str(tmp_path / "batches") in text
    policy = tmp_path / "default.toml"
    policy.write_text(text)
    stamp = tmp_path / "installed"  # this environment is installed already: make's stamp says so
    stamp.touch()
    log_path = tmp_path / "make-run.log"
    log_file = log_path.open("w")
    make = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(ROOT), "run", f"POLICY={policy}", "PORT=0",
         f"VENV={Path(sys.executable).parent.parent}", f"STAMP={stamp}"],
        stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    stop_started = time.monotonic()
    try:

        def listening() -> str | None:
            if m := re.search(r"listening on (http://\S+?) ", log_path.read_text()):
                return m.group(1)
            assert make.poll() is None, "make run exited: " + log_path.read_text()[-2000:]
            return None

        url = wait_until_blocking(
            listening, "the proxy listening", timeout=60, every=0.1, detail=lambda: log_path.read_text()[-2000:]
        )
        assert "controller auto" in log_path.read_text()
        demo_started = time.time()
        demo = subprocess.run(
            [sys.executable, "-m", "proxy", "demo", "--url", url, "--phases", "1", "--phase-s", "60",
             "--settle-s", "2", "--concurrency", "700"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr + demo.stdout[-2000:]
        assert "decision #" in demo.stdout and "output_budget [applied]" in demo.stdout, demo.stdout[-3000:]
        assert "the controller acted in 1 of 1 phase(s)" in demo.stdout
        assert re.search(r"sent \d+ · done \d+ \([\d.]+/s", demo.stdout)  # the status line's counts and rate
        # the fast tier acted first: the worker serves its own args with an output budget. The phase runs
        # on until the budget's measured gain is in (a restart that pays waits for it), and by then the
        # planner may have found one and begin it (its entry says so); the worker still serves its own args
        status = admin(url, "/admin/workers")
        workers = status["workers"]
        restarting = [d for d in admin(url, "/admin/decisions")["decisions"]
                      if d["rule"] == "planner" and d["status"] in ("acting", "applied")]  # fmt: skip
        assert workers[0]["state"] == "ready" or restarting, (workers, restarting)
        assert workers[0]["args"]["schedule_conservativeness"] == 1.0 or restarting, workers
        budget = workers[0]["output_budget"]["interactive"].get("4096")  # the demo's requests ask for 4096
        decisions = admin(url, "/admin/decisions")["decisions"]
        applied = [d for d in decisions if d["rule"] == "output_budget" and d["status"] == "applied"]
        assert applied and applied[0]["evidence"]["budget_tokens"] > 400, applied  # above every answer (100-400)
        # the budget the worker holds is the last journaled one, or a step from it the journal leaves
        # out (a move under ``budget_note_change`` of it, read from the answers still coming in)
        last = applied[-1]["evidence"]["budget_tokens"]
        if not restarting:  # a restarted worker's budget is read again from its own answers
            assert budget is not None and abs(budget - last) < PaceSettings().budget_note_change * last, (budget, last)
        # the dashboard shows the decision, within a minute of the demo's start, with the figures it was made on
        shown = [d for d in admin(url, "/admin/timeline")["decisions"] if d["id"] == applied[0]["id"]]
        assert shown and shown[0]["t"] - demo_started < 60, (shown, demo_started)
        assert shown[0]["evidence"]["budget_tokens"] == applied[0]["evidence"]["budget_tokens"]
        # with the gain the planner's twin predicts for it and the one measured, within the demo's run: the
        # worker's saturated pace with the budget over its pace with the budget held back a while, each
        # read once the requests sent the other way had ended (docs/dashboard.md)
        gains = shown[0]
        assert isinstance(gains.get("predicted_gain"), float), gains
        assert isinstance(gains.get("measured_gain"), float), gains
        assert isinstance(gains["met_prediction"], bool), gains  # within the twin's error, or not
        held = gains["outcome"]["held_back"]
        assert held["sent_max_tokens"] == 4096 and held["saturated_s"] > 0, gains["outcome"]  # as the clients ask
        shown_gain = rf"decision #{gains['id']} gain predicted [+-][\d.]+% measured [+-][\d.]+%"  # the demo says so
        assert re.search(shown_gain, demo.stdout), demo.stdout[-3000:]
        listed = subprocess.run([sys.executable, "-m", "proxy", "decisions", "--url", url],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        listed_gain = r"output_budget.*gain predicted [+-][\d.]+% measured [+-][\d.]+%"
        assert re.search(listed_gain, listed.stdout), listed.stdout

        # and the planner's view of the same load (its twin's replay of the answers served) with its
        # predicted gain; the planner computes on CPU time nothing else wants (the idle class), so on
        # cores shared with other tests its replay may end only once the demo's load has
        def planner_seen() -> list[dict]:
            return [d for d in admin(url, "/admin/timeline")["decisions"] if d["rule"] == "planner"]

        planned = wait_until_blocking(
            planner_seen, "a planner entry in the timeline", timeout=60, every=0.5,
            detail=lambda: str(admin(url, "/admin/decisions")["decisions"])[-2000:],
        )  # fmt: skip
        assert all(isinstance(d["predicted_gain"], float) for d in planned), planned
        pids = [w["pid"] for w in workers]
        assert all(pids)
        stop_started = time.monotonic()
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the terminal: make and the proxy get it
        try:
            make.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
            raise
        log_file.close()
    assert time.monotonic() - stop_started < 30
    rest = log_path.read_text()
    assert "stopped" in rest, rest[-2000:]
    for pid in pids:  # the simulated worker stopped with the proxy
        wait_until_blocking(lambda pid=pid: not pid_alive(pid), f"worker pid {pid} to end", every=0.1)
    decisions = [orjson.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert any(d["rule"] == "output_budget" and d["status"] == "applied" for d in decisions)
