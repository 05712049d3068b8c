"""Controller scenarios: ``python -m loadtests scenario NAME|all [--report FILE.json] [--arms default,adaptive,oracle]``

Each scenario (:mod:`loadtests.scenario_defs`) runs its arms on the simulated engine, one after
the other, each a real ``pacer serve`` process in front of ``pacer sim`` workers:

* ``default``: the scenario's starting arguments, control off;
* ``adaptive``: the same arguments, control ``auto`` (the controller may restart the worker);
* ``oracle``: the best static arguments of a sweep in virtual time (:mod:`loadtests.oracle`), control off;
* ``defaults``: SGLang's own defaults, control off;
* ``injected`` (scenarios with an operator trial, :class:`~loadtests.scenario_defs.Trial`): the
  adaptive arm, plus the trial sent to ``POST /admin/trial`` (what ``pacer try`` sends) at its moment.

Every arm runs the shipped ``[control]`` (``policies/default.toml``) as written, in the arm's mode
and its own directory; the report says what the adaptive arm ran (``control_hash``, ``control_is_shipped``).

A fleet scenario (``workers`` > 1) runs that many workers in one pool, each with the scenario's
arguments and its own ``worker_args`` over them in the arms that run the operator's arguments; the
oracle's sweep runs on one worker's share of the trace and its best arguments go to every worker.
Its report adds ``min_serving_fraction`` (the least share of the workers READY in any sample of
an arm under control), the injected trial as the journal tells it (``injection``: the canary's
verdict and figures, when it was reverted) and ``revert_cost`` (1 - the injected arm's throughput
over the adaptive arm's).

The workload is submitted at once through the proxy by an asyncio client (every request with
its true output length in ``sim_output_len``, so every arm sees the same outputs). Per arm:
``output_tok_per_s`` (completion tokens of the answered requests / seconds from the first
submission to the last answer), ``requests_ok``, ``requests_failed`` (answered with an error),
``requests_lost`` (never answered), ``retractions`` (the worker's retraction log lines, every
incarnation), ``restarts`` (worker restarts, from ``/admin/workers``), ``oom_crashes`` (OOM deaths
in the worker's log). The report also carries the decisions journal, the time series sampled every
0.5 s from ``/admin/workers`` and the worker's ``/metrics``, and the oracle's sweep. A markdown
table (``FILE.md``) and a plot (``FILE.png``) are written beside the report.

Judging: a scenario is judged on throughput (a backlog) or, with ``judged_on = "answer_time"``
(arrivals the best arguments keep up with), on each arm's mean modelled seconds from a request's
arrival to its answer (an arm that failed or lost a request scores nothing there); the report's
``adaptive_over_best_static`` and ``adaptive_over_default`` are ratios of that figure (higher is
better: the other arm's mean over the adaptive's), and the oracle's sweep scores the same.
``--sweep FILE`` keeps the sweep (deterministic in the scenario) between runs.
A shift of phases (``shift``, ``shift-perturbed``) is also judged against the per-phase oracle
(:mod:`loadtests.phase_oracle`, built from the same sweep): ``adaptive_over_phase_oracle``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from loadtests.oracle import PacedResult, Pacing, Restart, SearchSpace, sim_config, simulate_paced, sweep
from loadtests.phase_oracle import adaptive_over_phase_oracle, phase_oracle
from loadtests.scenario_defs import SCENARIOS, Phases, Scenario, Trial
from proxy.request.pacing import Band
from proxy.sim.request import RequestSpec

__all__ = [
    "ALL_ARMS",
    "ARMS",
    "SHIPPED_POLICY",
    "TRIAL_ARM",
    "ArmResult",
    "control_hash",
    "main",
    "policy_toml",
    "run_arm",
    "run_scenario",
    "shipped_control",
]

ARMS = ("default", "adaptive", "oracle", "defaults")
TRIAL_ARM = "injected"  # the adaptive arm with the scenario's operator trial (scenarios that have one)
# the adaptive arm on the workload's interactive parts only, where it also has a batch: what the interactive
# class's first tokens take with no batch running (mixed's target is a ratio to it)
ALONE_ARM = "alone"
ALL_ARMS = (*ARMS, TRIAL_ARM, ALONE_ARM)
ARM_KEYS = (
    "output_tok_per_s",
    "requests_ok",
    "requests_lost",
    "requests_failed",
    "retractions",
    "restarts",
    "oom_crashes",
)
SAMPLE_INTERVAL_S = 0.5
# a batch deployment's band: the queue is held near 100 + headroom; without a fresh sample the proxy
# sends at most running + 400 (not 2000 at once, which buries the worker before its first scrape)
PACING: dict[str, Any] = {"queue_band": [100, 400], "scrape_interval_s": 0.5, "stale_after_s": 3.0}
_LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")
_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_POLICY = _ROOT / "policies" / "default.toml"  # what `make run` serves: its [control] is the product


def shipped_control() -> dict[str, Any]:
    """The shipped policy's ``[control]`` table, as written there."""
    with SHIPPED_POLICY.open("rb") as f:
        return dict(tomllib.load(f).get("control", {}))


def control_hash(table: Mapping[str, Any]) -> str:
    """A short hash of a ``[control]`` table: its keys and values, in key order."""
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def arm_control(mode: str, control: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``[control]`` an arm runs: ``control`` (None: the shipped table) with the arm's mode. Its
    relative ``journal_path`` lands in the arm's own directory (the proxy runs there)."""
    return {**(shipped_control() if control is None else control), "mode": mode}


@dataclass(slots=True)
class ArmResult:
    arm: str
    args: dict[str, Any]
    control_mode: str
    output_tok_per_s: float = 0.0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_lost: int = 0
    retractions: int = 0
    retractions_counter: int = 0  # the same, from the /metrics counter followed through resets
    restarts: int = 0
    oom_crashes: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    last_answer_s: float = 0.0  # seconds from the first submission to the last answer (of any kind)
    errors: dict[str, int] = field(default_factory=dict)  # error answers by status
    final_args: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    series: list[dict[str, Any]] = field(default_factory=list)
    completions: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens) per ok answer
    sim_slowdown: float | None = None  # wall / engine-clock seconds of the last incarnation's steps (1: kept up)
    load_avg: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at the start and the end
    started: float = 0.0  # time.monotonic() at the first submission (the journal's "monotonic" is on the same clock)
    latencies: dict[int, float] = field(default_factory=dict)  # request index -> wall seconds from arrival to answer
    ttfts: dict[int, float] = field(default_factory=dict)  # streamed request index -> wall seconds to its first text
    arrivals: dict[int, float] = field(default_factory=dict)  # streamed request index -> wall seconds it was sent at
    time_scale: float = 1.0  # modelled seconds per wall second (the answer times below are modelled)
    proxy_peak_rss_mb: float | None = None  # the proxy process's peak resident memory (Linux: VmHWM)
    planner_peak_rss_mb: float | None = None  # its planner's process's (None: no plan ran)

    @property
    def mean_answer_s(self) -> float | None:
        """Mean modelled seconds from a request's arrival to its answer, over the answered ones."""
        if not self.latencies:
            return None
        return sum(self.latencies.values()) / len(self.latencies) * self.time_scale

    @property
    def p99_answer_s(self) -> float | None:
        if not self.latencies:
            return None
        lat = sorted(self.latencies.values())
        return lat[int(0.99 * (len(lat) - 1))] * self.time_scale

    def judged(self, judged_on: str) -> float:
        """The figure the arm is judged on, higher is better: output tokens per second, or for
        ``answer_time`` one over the mean time from arrival to answer; an arm that failed or lost a
        request scores 0 on answer time (its mean over the answered ones would flatter it)."""
        if judged_on != "answer_time":
            return self.output_tok_per_s
        mean = self.mean_answer_s
        if self.requests_failed or self.requests_lost or not mean:
            return 0.0
        return 1.0 / mean

    min_serving_fraction: float | None = None  # the least share of the workers READY in any sample
    trial: dict[str, Any] | None = None  # the operator's trial this arm injected: when, what the proxy answered

    def summary(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ARM_KEYS}
        out["output_tok_per_s"] = round(self.output_tok_per_s, 1)
        out.update(
            args=self.args,
            control_mode=self.control_mode,
            final_args=self.final_args,
            output_tokens=self.output_tokens,
            duration_s=round(self.duration_s, 2),
            retractions_counter=self.retractions_counter,
            errors=self.errors,
            sim_slowdown=None if self.sim_slowdown is None else round(self.sim_slowdown, 2),
            mean_answer_s=None if (m := self.mean_answer_s) is None else round(m, 2),
            p99_answer_s=None if (p := self.p99_answer_s) is None else round(p, 2),
            load_avg=[round(x, 1) for x in self.load_avg],
            min_serving_fraction=self.min_serving_fraction,
            proxy_peak_rss_mb=None if self.proxy_peak_rss_mb is None else round(self.proxy_peak_rss_mb),
            planner_peak_rss_mb=None if self.planner_peak_rss_mb is None else round(self.planner_peak_rss_mb),
        )
        if self.trial is not None:
            out["trial"] = self.trial
        return out


# -- the policy -------------------------------------------------------------------------------------


def policy_toml(
    sc: Scenario,
    args: Mapping[str, Any],
    mode: str,
    workdir: Path,
    worker_args: Sequence[Mapping[str, Any]] = (),
    control: Mapping[str, Any] | None = None,
) -> str:
    """The policy of one arm: ``sc.workers`` simulated workers with ``args`` (and each its own
    ``worker_args`` over them), control ``mode``; its other ``[control]`` keys are ``control``'s
    (None: the shipped policy's, unchanged)."""
    engine_extra: dict[str, Any] = {"worker_args": [dict(a) for a in worker_args]} if worker_args else {}
    tables: dict[str, dict[str, Any]] = {
        "proxy": {"host": "127.0.0.1", "port": 0, "request_timeout_s": 3600.0, "status_log_interval_s": 5.0},
        "queue": {"capacity": 100000, "timeout_s": sc.queue_timeout_s},
        "engine": {"kind": "sim", "workers": sc.workers, **engine_extra,
                   "args": {k: v for k, v in args.items() if v is not None},
                   "extra_args": sc.extra_args(), "log_dir": str(workdir / "logs"), "startup_timeout_s": 600.0,
                   # fixed on the wall clock, not scaled: the simulator's exit at SIGTERM (its server's
                   # cleanup) takes wall time whatever its modelled clock; 5 s bounds it below the default
                   "stop_grace_s": 5.0},
        "pacing": PACING,
        "control": arm_control(mode, control),
    }  # fmt: skip
    return tomli_w.dumps(tables)


# -- the proxy process ------------------------------------------------------------------------------


class ProxyProcess:
    """``pacer serve`` as a child process, run in ``cwd`` (the policy's relative paths land there: the
    journal, the batch store); its log goes to ``log_path``."""

    def __init__(self, policy_path: Path, log_path: Path, cwd: Path | None = None) -> None:
        self.policy_path = policy_path
        self.log_path = log_path
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self._pump: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 120.0) -> str:
        # the proxy of this checkout, wherever it runs
        path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--policy", str(self.policy_path), "--port", "0",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
            cwd=self.cwd,
        )  # fmt: skip
        found: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pump = asyncio.create_task(self._read_log(found))
        try:
            self.url = await asyncio.wait_for(asyncio.shield(found), timeout_s)
        except (TimeoutError, RuntimeError):
            await self.stop()
            raise RuntimeError(f"pacer serve did not start; see {self.log_path}") from None
        return self.url

    async def _read_log(self, found: asyncio.Future[str]) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with self.log_path.open("ab") as log:
            async for line in self.proc.stderr:
                log.write(line)
                if not found.done():
                    m = _LISTENING.search(line.decode(errors="replace"))
                    if m:
                        found.set_result(m.group(1))
        if not found.done():
            found.set_exception(RuntimeError("pacer serve exited"))

    def peak_rss_mb(self) -> float | None:
        """The process's peak resident memory so far, from ``/proc`` (None where there is none)."""
        return None if self.proc is None else _peak_rss_mb(self.proc.pid)

    def planner_peak_rss_mb(self) -> float | None:
        """The peak resident memory of the planner's process (the proxy's child spawned by
        ``multiprocessing``; its workers are children too), from ``/proc``; None: none started."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        peaks = []
        for child in children:
            try:
                spawned = b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if spawned and (peak := _peak_rss_mb(int(child))) is not None:
                peaks.append(peak)
        return sum(peaks) if peaks else None

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)


# -- load and observation ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Counter:
    """A counter followed through resets (a worker restart starts it at zero)."""

    total: float = 0.0
    last: float | None = None

    def feed(self, value: float | None) -> None:
        if value is None:
            return
        if self.last is not None:
            self.total += value - self.last if value >= self.last else value
        self.last = value


async def _get_json(session: Any, url: str) -> Any:
    async with session.get(url) as resp:
        return await resp.json()


async def _sample(
    session: Any, url: str, t0: float, series: list[dict[str, Any]], counters: dict[str, _Counter], stop: asyncio.Event
) -> None:
    """Every ``SAMPLE_INTERVAL_S``: the workers' states (``serving``: the share READY), the proxy's
    queue, and from each serving worker's ``/metrics`` its queue, running batch and token usage
    (summed over the workers; usage their mean) and its generation counter, followed through
    restarts (``gen_tokens_total``: all workers together)."""
    from proxy.engines.sglang.metrics import parse_metrics

    while not stop.is_set():
        tick = time.monotonic()
        try:
            body = await _get_json(session, url + "/admin/workers")
            workers = body["workers"]
            states = [w["state"] for w in workers]
            point: dict[str, Any] = {
                "t": round(tick - t0, 3),
                "state": states[0] if len(states) == 1 else "down" if "down" in states else
                         next((x for x in states if x != "ready"), "ready"),
                "pid": workers[0]["pid"],
                "restarts": sum(int(w["restarts"]) for w in workers),
                "serving": round(states.count("ready") / len(states), 4),
                "proxy_queue": sum(body["proxy_queue"].values()),
                "in_flight": body["in_flight"],
                "queue": None,
                "running": None,
                "token_usage": None,
                "gen_tokens_total": None,
            }  # fmt: skip
            if len(workers) > 1:
                point["states"] = states
            seen: list[Any] = []
            for w in workers:
                if w["state"] not in ("ready", "draining"):
                    continue
                try:
                    async with session.get(w["url"] + "/metrics") as resp:
                        sample = parse_metrics(await resp.text(), time.monotonic())
                except Exception:  # the worker went away between the two reads
                    continue
                counters.setdefault(f"retractions:{w['id']}", _Counter()).feed(sample.retractions_total)
                counters.setdefault(f"generation:{w['id']}", _Counter()).feed(sample.generation_tokens_total)
                seen.append(sample)
            if seen:
                point.update(
                    queue=sum(x.queue for x in seen),
                    running=sum(x.running for x in seen),
                    token_usage=round(sum(x.token_usage for x in seen) / len(seen), 4),
                    gen_tokens_total=round(sum(c.total for k, c in counters.items() if k.startswith("generation:"))),
                )
            series.append(point)
        except Exception as exc:  # keep sampling; one failed read is a gap in the plot
            series.append({"t": round(tick - t0, 3), "error": str(exc)[:200]})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - tick)))


async def _inject(
    session: Any, url: str, t0: float, trial: Trial, time_scale: float, stop: asyncio.Event
) -> dict[str, Any]:
    """The operator's trial, sent as ``pacer try`` sends it at ``trial.at_s`` modelled seconds; while
    the controller answers 409 (a restart or canary under way) it is sent again every half second."""
    await asyncio.sleep(max(0.0, t0 + trial.at_s / time_scale - time.monotonic()))
    body = {"worker": trial.worker, "args": dict(trial.args), "note": trial.note}
    refused: list[str] = []
    while not stop.is_set():
        async with session.post(url + "/admin/trial", json=body) as resp:
            answer = await resp.json()
            status = resp.status
        if status != 409:
            return {"sent_at_s": round(time.monotonic() - t0, 3), "status": status, "answer": answer,
                    "refused_first": len(refused), "first_refusal": refused[0] if refused else None}  # fmt: skip
        refused.append(str(answer.get("error", {}).get("message", answer)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return {"status": None, "refused_first": len(refused), "first_refusal": refused[0] if refused else None,
            "note": "the run ended before the controller took the trial"}  # fmt: skip


async def _one(
    session: Any,
    url: str,
    model: str,
    i: int,
    prompt: str,
    max_tokens: int,
    out_len: int,
    t0: float,
    res: ArmResult,
    at_s: float = 0.0,
    priority: str | None = None,
    stream: bool = False,
) -> None:
    """One request, sent ``at_s`` wall seconds after ``t0`` (its arrival), in class ``priority`` (the
    proxy's priority header), streamed when ``stream`` (its first content chunk timed)."""
    if at_s > 0:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "sim_output_len": out_len,
        "user": f"scenario-{i}",
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"x-pacer-priority": priority} if priority else None
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status == 200:
            if stream:
                tokens = 0
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices") and i not in res.ttfts and event["choices"][0].get("text"):
                        res.ttfts[i] = round(time.monotonic() - t0 - at_s, 4)
                        res.arrivals[i] = at_s
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
            else:
                data = await resp.json()
                tokens = int(data["usage"]["completion_tokens"])
            res.requests_ok += 1
            res.output_tokens += tokens
            res.completions.append((round(time.monotonic() - t0, 3), tokens))
            res.latencies[i] = round(time.monotonic() - t0 - at_s, 4)
        else:
            await resp.read()
            res.requests_failed += 1
            res.errors[str(resp.status)] = res.errors.get(str(resp.status), 0) + 1
    res.last_answer_s = max(res.last_answer_s, time.monotonic() - t0)


async def _sim_slowdown(session: Any, url: str) -> float | None:
    """How far the simulated engine fell behind its own clock: wall seconds its steps took over the
    engine-clock seconds they model (``/server_info``; 1.0 = it kept up; above it the run measures
    this machine's CPU, not the arguments). None when the worker does not say."""
    out = None
    try:
        for w in (await _get_json(session, url + "/admin/workers"))["workers"]:  # the slowest worker
            info = await _get_json(session, w["url"] + "/server_info")
            sim = info["internal_states"][0]["sim"]
            if sim["busy_modelled_s"] > 0:
                out = max(out or 0.0, sim["busy_wall_s"] / sim["busy_modelled_s"])
    except Exception:  # not a simulated worker, or it is gone
        pass
    return out


def _count_log(log_dir: Path) -> tuple[int, int]:
    """(retracted requests, out-of-memory deaths) in every worker log under ``log_dir``."""
    from proxy.engines.base import EventKind
    from proxy.engines.sglang.logs import LogFollower

    retracted = ooms = 0
    for path in sorted(log_dir.glob("*.log")):
        follower = LogFollower()
        with path.open(errors="replace") as f:
            events = follower.feed_all((line.rstrip("\n") for line in f), 0.0)
        events += follower.flush(0.0)
        for e in events:
            if e.kind is EventKind.RETRACTION and not e.fields.get("forced"):
                retracted += int(e.fields.get("retracted", 1))
            elif e.kind is EventKind.OOM:
                ooms += 1
    return retracted, ooms


async def run_arm(
    sc: Scenario,
    arm: str,
    args: Mapping[str, Any],
    mode: str,
    workdir: Path,
    *,
    max_run_s: float = 900.0,
    concurrency: int = 4000,
    worker_args: Sequence[Mapping[str, Any]] = (),
    trial: Trial | None = None,
    control: Mapping[str, Any] | None = None,
) -> ArmResult:
    """One arm, end to end: start the proxy, submit the workload (and ``trial``, an operator's, at its
    moment), follow it, stop, count. ``control``: the arm's ``[control]`` keys (None: the shipped ones)."""
    import aiohttp

    workdir = Path(workdir).resolve()  # the proxy runs there: the policy's paths must not be relative
    workdir.mkdir(parents=True, exist_ok=True)
    for old in (workdir / "logs").glob("*.log"):  # worker logs are appended: a re-run in the same workdir
        old.unlink()  # would count the earlier run's retractions and OOMs too
    policy = workdir / "policy.toml"
    policy.write_text(policy_toml(sc, args, mode, workdir, worker_args, control))
    res = ArmResult(
        arm=arm, args={k: v for k, v in args.items() if v is not None}, control_mode=mode, time_scale=sc.time_scale
    )
    requests = sc.workload.requests()
    proxy = ProxyProcess(policy, workdir / "proxy.log", cwd=workdir)
    url = await proxy.start()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
            deadline = time.monotonic() + 300
            while True:  # every worker is up and scraped
                try:
                    async with session.get(url + "/ready") as resp:
                        if resp.status == 200:
                            states = [w["state"] for w in (await _get_json(session, url + "/admin/workers"))["workers"]]
                            if all(x == "ready" for x in states):
                                break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{sc.name}/{arm}: the proxy never became ready; see {workdir}")
                await asyncio.sleep(0.2)
            model = (await _get_json(session, url + "/v1/models"))["data"][0]["id"]
            counters: dict[str, _Counter] = {}
            stop = asyncio.Event()
            load_start = os.getloadavg()[0]
            t0 = res.started = time.monotonic()
            sampler = asyncio.create_task(_sample(session, url, t0, res.series, counters, stop))
            injector = (
                asyncio.create_task(_inject(session, url, t0, trial, sc.time_scale, stop))
                if trial is not None
                else None
            )
            arrivals = [a / sc.time_scale for a in sc.workload.arrivals()]  # modelled -> wall seconds
            classes = sc.workload.classes()
            tasks = [
                asyncio.create_task(_one(session, url, model, i, p, m, o, t0, res, at, *classes[i]))
                for i, ((p, m, o), at) in enumerate(zip(requests, arrivals, strict=True))
            ]
            done, pending = await asyncio.wait(tasks, timeout=max_run_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            broken = [t.exception() for t in done if t.exception() is not None]
            res.errors.update({"client": len(broken)} if broken else {})
            # until the last answer; a run cut short by the deadline (or a broken connection) counts all of it
            res.duration_s = time.monotonic() - t0 if pending or broken else res.last_answer_s
            stop.set()
            await sampler
            if injector is not None:
                res.trial = await injector
            serving = [p["serving"] for p in res.series if "serving" in p]
            res.min_serving_fraction = min(serving) if serving else None
            res.sim_slowdown = await _sim_slowdown(session, url)
            res.load_avg = (load_start, os.getloadavg()[0])
            res.requests_lost = len(requests) - res.requests_ok - res.requests_failed
            res.output_tok_per_s = res.output_tokens / res.duration_s if res.duration_s > 0 else 0.0
            res.retractions_counter = round(sum(c.total for k, c in counters.items() if k.startswith("retractions:")))
            res.decisions = (await _get_json(session, url + "/admin/decisions"))["decisions"]
            workers = (await _get_json(session, url + "/admin/workers"))["workers"]
            res.restarts = sum(int(w["restarts"]) for w in workers)
            res.final_args = dict(workers[0]["args"]) if len(workers) == 1 else {w["id"]: w["args"] for w in workers}
            res.proxy_peak_rss_mb = proxy.peak_rss_mb()
            res.planner_peak_rss_mb = proxy.planner_peak_rss_mb()
    finally:
        await proxy.stop()
    res.retractions, res.oom_crashes = _count_log(workdir / "logs")
    return res


def _peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (Linux: ``VmHWM`` in ``/proc``; None where there is none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(m.group(1)) / 1024 if m else None


# -- a scenario -------------------------------------------------------------------------------------


def scenario_pacing(sc: Scenario) -> Pacing:
    """The arms' pacing gate (:data:`PACING`, the policy's default headroom) in the sweep's engine seconds."""
    from proxy.policy import PacingSettings

    lo, hi = PACING["queue_band"]
    return Pacing.of(Band(lo=lo, hi=hi, headroom=PacingSettings().headroom), PACING["scrape_interval_s"], sc.time_scale)


def oracle_args(sc: Scenario) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sweep's best static arguments, and the sweep itself for the report. Every trial feeds the
    engine through the arms' own pacing gate (:func:`scenario_pacing`) as the requests arrive: the
    arrival the arms see; each trial is scored on the figure the arms are judged on (``judged_on``)."""
    t = time.process_time()
    pacing = scenario_pacing(sc)
    # a fleet: one worker's share of the trace (every n-th request), its best arguments for all n
    specs = sc.workload.specs()[:: sc.workers]
    result = sweep(
        sc.start_args,
        specs,
        gpu=sc.gpu,
        model=sc.model,
        space=SearchSpace(min_available_gb=sc.min_available_gb, pacing=pacing, objective=sc.judged_on),
        perturb=sc.perturb_args(),
    )
    best = {k: v for k, v in result.best.args.items() if v is not None}
    info: dict[str, Any] = {
        "best": result.best.as_dict(),
        "start": result.start.as_dict(),
        "trials": len(result.trials),
        "cpu_s": round(time.process_time() - t, 1),
        "pacing": {"target": pacing.target, "scrape_s": pacing.scrape_s},
        "objective": sc.judged_on,
        "swept_on": "the whole trace"
        if sc.workers == 1
        else f"every {sc.workers}th request (one worker's share), the best for all {sc.workers} workers",
        "note": "modelled seconds (time scale 1), the engine fed through the proxy's pacing gate (arrivals over "
        "time: fed as they arrive); scored on "
        + ("1 / mean time from arrival to answer" if sc.judged_on == "answer_time" else "output tokens per second")
        + f"; OOM or a start-up failure scores 0; free memory at start-up >= {sc.min_available_gb:g} GB",
    }
    if isinstance(sc.workload, Phases) and sc.workers == 1:
        perturb = sc.perturb_args()

        def replay(args: Mapping[str, Any], requests: Sequence[RequestSpec]) -> Sequence[float]:
            cfg = sim_config(args, gpu=sc.gpu, model=sc.model, perturb=perturb)
            return simulate_paced(cfg, requests, pacing).answer_s

        info["phase_oracle"] = phase_oracle(sc.workload, result.trials, result.best, replay)
        info["cpu_s"] = round(time.process_time() - t, 1)
    return best, info


def restart_bound(sc: Scenario, adaptive: ArmResult, oracle: Mapping[str, Any]) -> dict[str, Any] | None:
    """What one restart at the adaptive arm's own moment costs, replayed in virtual time: the oracle's
    arguments and the adaptive arm's final ones, each switched to at that moment (the worker's start-up
    paid, its unfinished work taken back) and each run static from the start, as fractions of the
    oracle's static replay. ``oracle_args_restarted`` is the best any controller acting at that moment
    could have done; the live arm adds what the replay leaves out (scrapes, drain, CPU)."""
    applied = [d for d in adaptive.decisions if d.get("status") == "applied" and d.get("action") == "restart"]
    if not applied or not adaptive.started:
        return None
    at_s = max(0.0, (float(applied[0]["monotonic"]) - adaptive.started) * sc.time_scale)
    pacing, specs = scenario_pacing(sc), sc.workload.specs()
    start = sim_config(sc.start_args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args())
    static: dict[str, float] = {}
    moved: dict[str, float] = {}
    for name, args in (("oracle_args", oracle), ("adaptive_final_args", adaptive.final_args)):
        cfg = sim_config(
            args, gpu=sc.gpu, model=sc.model, perturb=sc.perturb_args()
        )  # time scale 1: its start-up is the modelled one
        static[name] = _replay_score(sc, simulate_paced(cfg, specs, pacing))
        restart = Restart(at_s=at_s, config=cfg, startup_s=cfg.startup_wall_seconds)
        moved[name] = _replay_score(sc, simulate_paced(start, specs, pacing, restart))
    base = static["oracle_args"]
    if base <= 0:
        return None
    out: dict[str, Any] = {"restart_at_modelled_s": round(at_s, 1), "restarts_live": adaptive.restarts}
    for name in static:
        out[f"{name}_restarted"] = round(moved[name] / base, 3)
        out[f"{name}_static"] = round(static[name] / base, 3)
    return out


def _replay_score(sc: Scenario, res: PacedResult) -> float:
    """A replay scored as the arms are judged (higher is better; 0 when it died)."""
    if res.oom is not None:
        return 0.0
    if sc.judged_on == "answer_time":
        return 1.0 / res.mean_answer_s if res.mean_answer_s > 0 else 0.0
    return res.output_tok_per_s


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def run_scenario(
    sc: Scenario,
    report_path: Path,
    *,
    arms: Sequence[str] = ARMS,
    workdir: Path | None = None,
    max_run_s: float = 900.0,
    oracle: Mapping[str, Any] | None = None,
    sweep_path: Path | None = None,
    control: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the arms, write ``report_path`` (JSON), its ``.md`` table and ``.png`` plot; return the report.
    ``sweep_path``: the oracle's sweep is read from there when it exists, else run and written there
    (the sweep is deterministic in the scenario; an hour's trace costs minutes of CPU per sweep).
    ``control``: the ``[control]`` keys every arm runs (each with its own mode); None, what a
    benchmark runs: the shipped policy's, unchanged (the report's ``control_is_shipped``)."""
    from loadtests.plot import plot_scenario

    report_path = Path(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"pacer-scenario-{sc.name}-"))
    sweep_info: dict[str, Any] = {}
    if "oracle" in arms:
        if oracle is None and sweep_path is not None and Path(sweep_path).exists():
            saved = json.loads(Path(sweep_path).read_text())
            if saved.get("scenario") != sc.name:
                raise ValueError(f"{sweep_path} holds the sweep of {saved.get('scenario')!r}, not {sc.name!r}")
            best, sweep_info = saved["args"], saved["sweep"]
        elif oracle is None:
            best, sweep_info = oracle_args(sc)
            if sweep_path is not None:
                Path(sweep_path).write_text(json.dumps({"scenario": sc.name, "args": best, "sweep": sweep_info}))
        else:
            best, sweep_info = dict(oracle), {"best": {"args": dict(oracle)}, "note": "given"}
    results: dict[str, ArmResult] = {}
    for arm in arms:
        if arm == ALONE_ARM:  # run after the others (_alone_ttft), outside the arms compared
            continue
        own: Sequence[Mapping[str, Any]] = sc.worker_args  # the operator's arguments: each worker's own too
        trial = None
        if arm == "default":
            args, mode = dict(sc.start_args), "off"
        elif arm == "adaptive":
            args, mode = dict(sc.start_args), "auto"
        elif arm == TRIAL_ARM:  # the adaptive arm with the operator's trial injected
            if sc.trial is None:
                continue
            args, mode, trial = dict(sc.start_args), "auto", sc.trial
        elif arm == "oracle":
            args, mode, own = best, "off", ()
        elif arm == "defaults":  # SGLang's own defaults, no control
            args, mode, own = {}, "off", ()
        else:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ALL_ARMS)}")
        print(f"[{sc.name}] {arm}: args {args}, worker args {list(own)}, control {mode}", file=sys.stderr, flush=True)
        r = asyncio.run(run_arm(sc, arm, args, mode, base / arm, max_run_s=max_run_s, worker_args=own, trial=trial,
                                control=control))  # fmt: skip
        print(f"[{sc.name}] {arm}: {r.output_tok_per_s:.0f} tok/s, ok {r.requests_ok}, failed {r.requests_failed}, "
              f"lost {r.requests_lost}, retractions {r.retractions}, restarts {r.restarts}, OOM {r.oom_crashes}, "
              f"{r.duration_s:.1f} s, sim slowdown {r.sim_slowdown if r.sim_slowdown is None else round(r.sim_slowdown, 2)}, "
              f"load {r.load_avg[0]:.1f} -> {r.load_avg[1]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
        results[arm] = r
    alone_p99 = _alone_ttft(sc, base, max_run_s, control) if ALONE_ARM in arms else None
    tps = {a: r.judged(sc.judged_on) for a, r in results.items()}  # the judged figure (higher is better)
    throughput = {a: r.output_tok_per_s for a, r in results.items()}
    bound = (
        restart_bound(sc, results["adaptive"], best)
        if {"adaptive", "oracle"} <= set(results) and sc.workers == 1
        else None
    )
    decisions = results["adaptive"].decisions if "adaptive" in results else []
    errors = [float(d["prediction_error"]) for d in decisions if isinstance(d.get("prediction_error"), (int, float))]
    answers = [float(d["answer_error"]) for d in decisions if isinstance(d.get("answer_error"), (int, float))]
    # plans that did not pay: the twin's prediction for the args the worker ran, against what it measured
    twin_errors = [
        float(d["current_prediction_error"]) for d in decisions
        if isinstance(d.get("current_prediction_error"), (int, float))
    ]  # fmt: skip
    # each checked plan's gain: predicted, measured on the requests served under its args (against the twin
    # under the old args on them), and the first window's, after over before (mostly the restart's refill)
    names = {"predicted": "predicted_gain", "measured": "measured_gain", "first_window": "first_window_gain"}
    gains = [{key: d.get(name) for key, name in names.items()} for d in decisions if "gain_requests" in d]
    report: dict[str, Any] = {
        "lost": sum(r.requests_lost for r in results.values()),
        "adaptive_over_best_static": _ratio(tps.get("adaptive", 0.0), tps.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(tps) else None,
        "adaptive_over_default": _ratio(tps.get("adaptive", 0.0), tps.get("default", 0.0)) if {"adaptive", "default"} <= set(tps) else None,
        "adaptive_over_sglang_defaults": _ratio(tps.get("adaptive", 0.0), tps.get("defaults", 0.0)) if {"adaptive", "defaults"} <= set(tps) else None,
        "judged_on": sc.judged_on,
        "sim_slowdown": {a: None if r.sim_slowdown is None else round(r.sim_slowdown, 3) for a, r in results.items()},
        "throughput_over_best_static": _ratio(throughput.get("adaptive", 0.0), throughput.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(throughput) else None,
        "mean_answer_s": {a: None if (m := r.mean_answer_s) is None else round(m, 2) for a, r in results.items()},
        "prediction_error_median": round(statistics.median(errors or twin_errors), 4) if errors or twin_errors else None,
        "prediction_error_basis": "acted plans" if errors else "plans not acted on (current args)" if twin_errors else None,
        # acted plans checked on the requests served under their args (the twin out of sample)
        "plans_checked": len(errors),
        # acted plans on the throughput basis: the twin's mean answer time against the worker's, on the same requests
        "answer_error_median": round(statistics.median(answers), 4) if answers else None,
        "plan_gains": gains,
        # the twin on the requests it replayed under the args the worker ran (in sample, every plan not acted on)
        "twin_error_median": round(statistics.median(twin_errors), 4) if twin_errors else None,
        "plans_noted": len(twin_errors),
        "restarts": results["adaptive"].restarts if "adaptive" in results else None,
        "phases": (phases := _phase_figures(sc, results)),
        **_phase_judged(phases),
        "interactive_ttft_p99_s": (ttft := _interactive_ttft(sc, results)),
        "interactive_ttft_p99_alone_s": alone_p99,
        "interactive_ttft_over_alone": _ratio(ttft["adaptive"], alone_p99) if alone_p99 and ttft and "adaptive" in ttft else None,
        **(_fleet_figures(sc, results) if sc.workers > 1 else {}),
        "scenario": sc.name,
        "premise": sc.premise,
        "gpu": sc.gpu,
        "model": sc.model,
        "time_scale": sc.time_scale,
        "workload": sc.workload.describe(),
        # the [control] the adaptive arm ran with, and whether it is the shipped policy's unchanged
        "control": (ran := arm_control("auto", control)),
        "control_hash": control_hash(ran),
        "shipped_control_hash": control_hash(shipped := shipped_control()),
        "control_is_shipped": ran == shipped,
        "phase_oracle": sweep_info.get("phase_oracle"),
        **_phase_oracle_judged(phases, sweep_info),
        "arms": {a: r.summary() for a, r in results.items()},
        "adaptive_over_oracle": _ratio(tps.get("adaptive", 0.0), tps.get("oracle", 0.0)) if {"adaptive", "oracle"} <= set(tps) else None,
        "oracle_sweep": sweep_info,
        "restart_bound": bound,
        "decisions": {a: r.decisions for a, r in results.items() if r.decisions},
        "series": {a: r.series for a, r in results.items()},
        "completions": {a: r.completions for a, r in results.items()},
        # each streamed request's arrival and time to its first text (modelled seconds), in arrival order
        "first_tokens": {a: [[round(r.arrivals[i] * sc.time_scale, 2), round(r.ttfts[i] * sc.time_scale, 3)]
                             for i in sorted(r.ttfts, key=r.arrivals.__getitem__)]
                         for a, r in results.items() if r.ttfts},
        "workdir": str(base),
    }  # fmt: skip
    report_path.write_text(json.dumps(report, indent=1))
    report_path.with_suffix(".md").write_text(table([report]) + "\n")
    plot_scenario(report, report_path.with_suffix(".png"))
    return report


def _phase_oracle_judged(phases: list[dict[str, Any]] | None, sweep_info: Mapping[str, Any]) -> dict[str, Any]:
    """The adaptive arm against the per-phase oracle (:mod:`loadtests.phase_oracle`): the ratio (None
    where there is none: not a shift of phases, no live oracle arm, or a sweep kept from before it)."""
    judged = adaptive_over_phase_oracle(phases, sweep_info.get("phase_oracle"))
    return {
        "adaptive_over_phase_oracle": None if judged is None else judged["ratio"],
        "phase_oracle_ratios": None if judged is None else judged["phase_ratios"],
    }


def _fleet_figures(sc: Scenario, results: Mapping[str, ArmResult]) -> dict[str, Any]:
    """A fleet's figures: the least share of its workers serving (READY) in any sample of an arm
    under control, and the operator's injected trial: what the canary judged, when it was
    reverted, and its cost (1 - the injected arm's throughput over the adaptive arm's)."""
    controlled = {a: r.min_serving_fraction for a, r in results.items() if r.control_mode == "auto"}
    seen = [v for v in controlled.values() if v is not None]
    out: dict[str, Any] = {
        "min_serving_fraction": min(seen) if seen else None,
        "min_serving_fraction_by_arm": {a: r.min_serving_fraction for a, r in results.items()},
        "workers": sc.workers,
        "worker_args": [dict(a) for a in sc.worker_args],
        "best_static_basis": f"all {sc.workers} workers with the sweep's best arguments for one worker's share "
        "of the trace (the oracle arm)",
    }
    injected, adaptive = results.get(TRIAL_ARM), results.get("adaptive")
    if injected is None:
        return out
    out["revert_cost"] = (
        round(1.0 - injected.output_tok_per_s / adaptive.output_tok_per_s, 4)
        if adaptive is not None and adaptive.output_tok_per_s > 0
        else None
    )
    out["injection"] = _injection(sc, injected)
    return out


def _injection(sc: Scenario, r: ArmResult) -> dict[str, Any]:
    """The injected trial as the journal tells it: its entry, the canary's verdict and figures, and the
    revert (modelled seconds from the trial to the worker serving with its own arguments again)."""
    assert sc.trial is not None
    sent = r.trial or {}
    entry_id = (sent.get("answer") or {}).get("entry") if sent.get("status") == 202 else None
    out: dict[str, Any] = {"worker": sc.trial.worker, "args": dict(sc.trial.args), "at_modelled_s": sc.trial.at_s,
                           "sent": sent}  # fmt: skip
    entry = next((d for d in r.decisions if d.get("id") == entry_id), None)
    if entry is None:
        return out
    out.update(
        entry=entry_id,
        status=entry.get("status"),
        canary_verdict=entry.get("canary_verdict"),
        canary_share_before=entry.get("canary_share_before"),
        canary_share_after=entry.get("canary_share_after"),
    )
    revert = next((d for d in r.decisions if d.get("rule") == "canary_revert" and d.get("worker") == sc.trial.worker
                   and int(d.get("id", 0)) > int(entry["id"])), None)  # fmt: skip
    if revert is not None:
        out.update(revert_entry=revert.get("id"), revert_status=revert.get("status"),
                   reverted_after_modelled_s=round((float(revert["monotonic"]) - float(entry["monotonic"]))
                                                   * sc.time_scale, 1))  # fmt: skip
    return out


def _phase_figures(sc: Scenario, results: Mapping[str, ArmResult]) -> list[dict[str, Any]] | None:
    """Per phase of a phased workload and per arm: mean and p99 time from arrival to answer (modelled
    seconds) and output tokens per modelled second from the phase's first arrival to its last answer.
    A phase that arrives over time is judged on its time to answer; a batch on its throughput."""
    if not isinstance(sc.workload, Phases):
        return None
    phase_of, arrivals, outputs = sc.workload.phase_of(), sc.workload.arrivals(), [r[2] for r in sc.workload.requests()]
    out = []
    for k, part in enumerate(sc.workload.parts):
        idx = [i for i, p in enumerate(phase_of) if p == k]
        judged = "throughput" if part.rate is None else "time to first token (p99)" if part.stream else "queue time"
        row: dict[str, Any] = {"phase": k, "judged_on": judged}
        for arm, r in results.items():
            lat = sorted(r.latencies[i] * sc.time_scale for i in idx if i in r.latencies)
            if not lat:
                continue
            first = min(arrivals[i] for i in idx)
            last = max(arrivals[i] + r.latencies[i] * sc.time_scale for i in idx if i in r.latencies)
            tokens = sum(outputs[i] for i in idx if i in r.latencies)
            row[arm] = {"mean_s": round(sum(lat) / len(lat), 2), "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 2),
                        "tok_per_s": round(tokens / (last - first), 1) if last > first else None}  # fmt: skip
            ttft = sorted(r.ttfts[i] * sc.time_scale for i in idx if i in r.ttfts)
            if ttft:
                row[arm].update(ttft_mean_s=round(sum(ttft) / len(ttft), 3),
                                ttft_p99_s=round(ttft[int(0.99 * (len(ttft) - 1))], 3))  # fmt: skip
        out.append(row)
    return out


STATIC_ARMS = ("default", "oracle", "defaults")


def _alone_ttft(sc: Scenario, base: Path, max_run_s: float, control: Mapping[str, Any] | None) -> float | None:
    """The p99 time to first token (modelled seconds) of the interactive class with no batch running: the
    adaptive arm on the workload's interactive parts alone (None: the workload is not of both classes)."""
    parts = sc.workload.parts if isinstance(sc.workload, Phases) else (sc.workload,)
    chat = tuple(p for p in parts if p.priority == "interactive")
    if not chat or len(chat) == len(parts):
        return None
    alone = dataclasses.replace(sc, workload=Phases(parts=chat))
    print(f"[{sc.name}] {ALONE_ARM}: the interactive parts only, control auto", file=sys.stderr, flush=True)
    r = asyncio.run(run_arm(alone, ALONE_ARM, dict(sc.start_args), "auto", base / ALONE_ARM, max_run_s=max_run_s,
                            worker_args=sc.worker_args, trial=None, control=control))  # fmt: skip
    return (_interactive_ttft(alone, {ALONE_ARM: r}) or {}).get(ALONE_ARM)


def _interactive_ttft(sc: Scenario, results: Mapping[str, ArmResult]) -> dict[str, float] | None:
    """Per arm, the p99 time to first token (modelled seconds) of the requests sent as ``interactive``."""
    idx = [i for i, (priority, _) in enumerate(sc.workload.classes()) if priority == "interactive"]
    out = {}
    for arm, r in results.items():
        ttft = sorted(r.ttfts[i] * sc.time_scale for i in idx if i in r.ttfts)
        if ttft:
            out[arm] = round(ttft[int(0.99 * (len(ttft) - 1))], 3)
    return out or None


def _phase_judged(phases: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A phased run judged phase by phase: against each static arm, the adaptive arm's ratio per phase
    (its throughput over the arm's for a batch; the arm's mean time to answer over its own for
    arrivals over time, or its p99 time to first token for streamed ones: above 1 is better) and their geometric mean; the best static arm is
    the one the adaptive arm does worst against. Only the static arms that ran are compared (the
    sweep's best is chosen on the whole run's throughput, not on this)."""
    if not phases:
        return {}
    by_arm: dict[str, list[float]] = {}
    for row in phases:
        mine = row.get("adaptive")
        if not isinstance(mine, dict):
            return {}
        for arm in STATIC_ARMS:
            other = row.get(arm)
            if not isinstance(other, dict):
                continue
            if row["judged_on"] == "throughput":
                a, b = mine.get("tok_per_s"), other.get("tok_per_s")
            elif row["judged_on"].startswith("time to first token"):
                a, b = other.get("ttft_p99_s"), mine.get("ttft_p99_s")
            else:
                a, b = other.get("mean_s"), mine.get("mean_s")
            if a and b:
                by_arm.setdefault(arm, []).append(a / b)
    scores = {arm: (statistics.geometric_mean(r), r) for arm, r in by_arm.items() if len(r) == len(phases)}
    if not scores:
        return {}
    worst = min(scores, key=lambda arm: scores[arm][0])
    return {
        "adaptive_over_best_static_by_phase": round(scores[worst][0], 4),
        "best_static_by_phase": worst,
        "phase_ratios": {arm: [round(x, 4) for x in r] for arm, (_, r) in scores.items()},
    }


def _opt3(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def _control_label(rep: Mapping[str, Any]) -> str:
    """The adaptive arm's [control]: as shipped, or another (its hash)."""
    if "control_is_shipped" not in rep:
        return "-"
    return "shipped" if rep["control_is_shipped"] else f"not shipped ({rep.get('control_hash')})"


def _opt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _load(value: Any) -> str:
    return "-" if not value else f"{value[0]:.1f}-{value[1]:.1f}"


def _rss(arm: Mapping[str, Any]) -> str:
    proxy, planner = arm.get("proxy_peak_rss_mb"), arm.get("planner_peak_rss_mb")
    return f"{proxy or '-'}" + ("" if planner is None else f" (+ {planner})")


def table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One markdown table: a row per scenario and arm."""
    head = (
        "| scenario | arm | output tok/s | mean answer s | ok | failed | lost | retractions | restarts | OOM crashes | "
        "sim slowdown | load avg | proxy peak RSS MB (+ planner's process) | args at the end |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    rows = [head]
    for rep in reports:
        for arm, a in rep["arms"].items():
            final = ", ".join(f"{k}={v}" for k, v in sorted(a["final_args"].items())) or "(SGLang defaults)"
            rows.append(f"| {rep['scenario']} | {arm} | {a['output_tok_per_s']:.0f} | {_opt(a.get('mean_answer_s'))} | {a['requests_ok']} | "
                        f"{a['requests_failed']} | {a['requests_lost']} | {a['retractions']} | {a['restarts']} | "
                        f"{a['oom_crashes']} | {_opt(a.get('sim_slowdown'))} | {_load(a.get('load_avg'))} | "
                        f"{_rss(a)} | {final} |")  # fmt: skip
    ratios = [
        "",
        "| scenario | judged on | adaptive / oracle | adaptive / default | replay: oracle args from the adaptive's restart "
        "| replay: adaptive's final args from its restart | modelled s of the restart | adaptive / per-phase oracle "
        "| control |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rep in reports:
        ao, ad = rep.get("adaptive_over_oracle"), rep.get("adaptive_over_default")
        b = rep.get("restart_bound") or {}
        ratios.append(
            f"| {rep['scenario']} | {rep.get('judged_on', 'throughput')} | {'-' if ao is None else f'{ao:.3f}'} | "
            f"{'- (default delivered nothing)' if ad is None and 'default' in rep['arms'] else '-' if ad is None else f'{ad:.3f}'} | "
            f"{b.get('oracle_args_restarted', '-')} | {b.get('adaptive_final_args_restarted', '-')} | {b.get('restart_at_modelled_s', '-')} | "
            f"{_opt3(rep.get('adaptive_over_phase_oracle'))} | {_control_label(rep)} |"
        )
    return "\n".join(rows + ratios)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests scenario", description=__doc__.split("\n")[0])
    p.add_argument("name", choices=[*SCENARIOS, "all"])
    p.add_argument("--report", default=None, help="JSON report (default: scenario-NAME.json); .md and .png beside it")
    p.add_argument("--arms", default=",".join(ALL_ARMS), help="comma-separated subset of " + ",".join(ALL_ARMS)
                   + f" ({TRIAL_ARM}: scenarios with an operator trial only)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="keep each arm's policy, logs and journal here")
    p.add_argument("--max-run-s", type=float, default=900.0, help="give up on an arm after this long")
    p.add_argument(
        "--sweep",
        default=None,
        help="the oracle's sweep: read from this JSON file if it exists, else run and written there",
    )
    ns = p.parse_args(argv)
    arms = [a.strip() for a in ns.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ALL_ARMS]
    if bad:
        p.error(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ALL_ARMS)}")
    names = list(SCENARIOS) if ns.name == "all" else [ns.name]
    report = Path(ns.report or f"scenario-{ns.name}.json")
    reports = []
    for name in names:
        path = report if len(names) == 1 else report.with_name(f"{report.stem}-{name}.json")
        work = Path(ns.workdir) / name if ns.workdir else None
        sweep_path = (
            None
            if ns.sweep is None
            else Path(ns.sweep)
            if len(names) == 1
            else Path(ns.sweep).with_name(f"{Path(ns.sweep).stem}-{name}.json")
        )
        reports.append(
            run_scenario(SCENARIOS[name], path, arms=arms, workdir=work, max_run_s=ns.max_run_s, sweep_path=sweep_path)
        )
    if len(names) > 1:
        report.write_text(
            json.dumps(
                {
                    "scenarios": {
                        r["scenario"]: {
                            k: r[k]
                            for k in (
                                "arms",
                                "adaptive_over_oracle",
                                "adaptive_over_default",
                                "adaptive_over_phase_oracle",
                                "control_hash",
                                "control_is_shipped",
                            )
                        }
                        for r in reports
                    }
                },
                indent=1,
            )
        )
        report.with_suffix(".md").write_text(table(reports) + "\n")
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
