"""Real processes for benchmarks: start, wait until they answer, read their CPU time, stop.

Each process writes its log to a file (never a pipe, so nothing in the benchmark has to drain it
while it measures) and runs in its own process group, so :meth:`Proc.stop` ends it and any child.

    with ExitStack() as stack:
        sim = stack.enter_context(start_sim(tmp, time_scale=100))
        proxy = stack.enter_context(start_pacer(tmp, [sim.url]))
        router = stack.enter_context(start_router(tmp, sim.url))
        ...  # every process is stopped on the way out, whatever happened
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from proxy.workers import supervisor

ROOT = Path(__file__).resolve().parents[1]


class ProcError(RuntimeError):
    """A benchmark process did not start; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    return supervisor.free_port(host)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens there: a server could bind it (TIME_WAIT leftovers do not count)."""
    return supervisor.port_is_free(host, port)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (its threads included, its children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the threads of ``pid`` were runnable but waiting for a CPU (``/proc/<pid>/task/*/schedstat``):
    on a shared machine, how much other processes delayed it."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), from ``/proc``; gone ones are skipped."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in task.read_text().split()]
                out.extend(kids)
                todo.extend(kids)
    return out


def tree_usage(pid: int) -> dict[int, tuple[float, float]]:
    """``pid`` and each of its descendants: (CPU seconds, seconds waiting for a CPU) so far."""
    usage: dict[int, tuple[float, float]] = {}
    for one in (pid, *descendants(pid)):
        with contextlib.suppress(OSError, IndexError, ValueError):
            usage[one] = (cpu_seconds(one), runqueue_wait_seconds(one))
    return usage


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    url: str
    log: Path
    ports: tuple[int, ...]
    lag_file: Path | None = None  # where its event loop's lag probe writes (``loadtests.loop_lag``), if it has one

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def runqueue_wait_seconds(self) -> float:
        return runqueue_wait_seconds(self.pid)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        # children that outlived the leader (none expected) go with the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status: int = resp.status
            return 200 <= status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pinned(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that limits the child (and every thread and process it starts) to ``cpus``."""
    if not cpus:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def _launch(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    url: str,
    probe: str,
    ports: tuple[int, ...],
    timeout_s: float,
    cpus: frozenset[int] | None = None,
    lag_file: Path | None = None,
) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    if lag_file is not None:
        lag_file.unlink(missing_ok=True)  # the probe appends: nothing from an earlier run in the same folder
    with open(log, "wb") as fh:
        popen = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_pinned(cpus),
        )
    proc = Proc(name, popen, url, log, ports, lag_file)
    deadline = time.monotonic() + timeout_s
    try:
        while not _http_ok(url + probe):
            if popen.poll() is not None:
                raise ProcError(f"{name} exited with {popen.returncode} before it was ready:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcError(f"{name} did not answer {probe} within {timeout_s:g} s:\n{proc.log_tail()}")
            time.sleep(0.1)
    except BaseException:
        proc.stop()
        raise
    return proc


def _pacer_command(lag_file: Path | None) -> list[str]:
    """``python -m proxy``, or with ``lag_file`` the same through the event-loop lag probe."""
    if lag_file is None:
        return [sys.executable, "-m", "proxy"]
    return [sys.executable, "-m", "loadtests.loop_lag", str(lag_file), "proxy"]


@contextlib.contextmanager
def running(proc: Proc) -> Iterator[Proc]:
    try:
        yield proc
    finally:
        proc.stop()


def start_sim(
    log_dir: Path,
    *,
    time_scale: float,
    extra: Sequence[str] = (),
    name: str = "sim",
    timeout_s: float = 60.0,
    cpus: frozenset[int] | None = None,
    lag_file: Path | None = None,
) -> contextlib.AbstractContextManager[Proc]:
    """``pacer sim`` on a free port, ready (``/health`` answers 200) when this returns; on ``cpus`` only
    when given, its event loop's lag written to ``lag_file`` when given (likewise for ``start_pacer``)."""
    port = free_port()
    argv = [
        *_pacer_command(lag_file),
        "sim",
        "--port",
        str(port),
        "--sim-time-scale",
        f"{time_scale:g}",
        "--sim-startup-seconds",
        "0.2",
        "--enable-metrics",
        "--log-level",
        "warning",
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    return running(_launch(name, argv, log_dir, url, "/health", (port,), timeout_s, cpus, lag_file))


def pacer_policy(
    worker_urls: Sequence[str],
    *,
    queue_band: tuple[int, int] = (2000, 20000),
    headroom: int = 2000,
    scrape_interval_s: float = 0.5,
) -> str:
    """A policy TOML for ``pacer serve`` in front of external workers, with a pacing band wide enough
    that the gate never holds a request back at benchmark loads (the benchmark measures the relay)."""
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0},
        "queue": {"capacity": 100000, "timeout_s": 120.0},
        "engine": {"kind": "external", "urls": list(worker_urls)},
        "pacing": {"queue_band": list(queue_band), "headroom": headroom, "scrape_interval_s": scrape_interval_s,
                   "stale_after_s": 30.0},
        "control": {"mode": "off"},
    })  # fmt: skip


def start_pacer(
    log_dir: Path,
    worker_urls: Sequence[str],
    *,
    name: str = "pacer",
    timeout_s: float = 60.0,
    cpus: frozenset[int] | None = None,
    policy_text: str | None = None,
    lag_file: Path | None = None,
) -> contextlib.AbstractContextManager[Proc]:
    """``pacer serve`` with :func:`pacer_policy` (or ``policy_text``), ready (``/ready`` answers 200)
    when this returns."""
    log_dir.mkdir(parents=True, exist_ok=True)
    policy = log_dir / f"{name}-policy.toml"
    policy.write_text(policy_text if policy_text is not None else pacer_policy(worker_urls))
    port = free_port()
    argv = [
        *_pacer_command(lag_file),
        "serve",
        "--policy",
        str(policy),
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    url = f"http://127.0.0.1:{port}"
    return running(_launch(name, argv, log_dir, url, "/ready", (port,), timeout_s, cpus, lag_file))


def start_router(
    log_dir: Path,
    worker_url: str,
    *,
    max_concurrent: int = 4096,
    queue_size: int = 4096,
    name: str = "sglang-router",
    timeout_s: float = 90.0,
    cpus: frozenset[int] | None = None,
) -> contextlib.AbstractContextManager[Proc]:
    """SGLang's router (``sglang-router``) in front of one worker, with its concurrency limit and queue on.

    Its token bucket refills at ``--rate-limit-tokens-per-second`` (by default as many per second as
    ``--max-concurrent-requests``); it is set far above the benchmark's request rate so that only the
    concurrency limit and queue act, as in :func:`pacer_policy`.
    """
    port, prom = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--policy",
        "round_robin",
        "--max-concurrent-requests",
        str(max_concurrent),
        "--queue-size",
        str(queue_size),
        "--rate-limit-tokens-per-second",
        str(max_concurrent * 100),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prom),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warn",
    ]
    return running(
        _launch(name, argv, log_dir, f"http://127.0.0.1:{port}", "/readiness", (port, prom), timeout_s, cpus)
    )
