"""One arm of a scenario, end to end: a ``pacer serve`` process, the workload through it, what it counted.

The arms (:data:`ALL_ARMS`):

* ``default``: the scenario's starting arguments, control off;
* ``adaptive``: the same arguments, control ``auto`` (the controller may restart the worker);
* ``oracle``: the best static arguments of a sweep in virtual time (:mod:`loadtests.oracle`), control off;
* ``defaults``: SGLang's own defaults, control off;
* ``injected`` (scenarios with an operator trial, :class:`~loadtests.scenario_defs.Trial`): the
  adaptive arm, plus the trial sent to ``POST /admin/trial`` (what ``pacer try`` sends) at its moment;
* ``alone``: the adaptive arm on the workload's interactive parts only (a workload of both classes).

The workload is submitted at once through the proxy by an asyncio client (every request with its true
output length in ``sim_output_len``, so every arm sees the same outputs). An :class:`ArmResult` holds
the requests answered, failed (an error) and lost (never answered), output tokens per second (from
the first submission to the last answer), the worker's retractions and OOM deaths (its logs, every
incarnation) and restarts, the decisions journal, and the series sampled every ``SAMPLE_INTERVAL_S``
from ``/admin/workers`` and the workers' ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.procs import cpu_seconds, runqueue_wait_seconds, tree_usage
from loadtests.scenario_defs import Scenario, Trial
from loadtests.scenario_proxy import ProxyProcess, policy_toml

__all__ = ["ALL_ARMS", "ALONE_ARM", "ARMS", "ARM_KEYS", "SAMPLE_INTERVAL_S", "TRIAL_ARM", "ArmResult", "run_arm"]

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
    # per role (client: this process; proxy; its workers; its planner's processes):
    # CPU cores used and the share of the run its threads waited for a CPU (run-queue wait, from /proc)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    output_budgets: dict[str, Any] = field(default_factory=dict)  # per worker, the output budgets at the end
    continuations: float | None = None  # answers continued past their output budget (the proxy's counter)

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
            cpu=self.cpu,  # per role: cores used and the share of the time its threads waited for a CPU
        )
        if self.trial is not None:
            out["trial"] = self.trial
        return out


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
                "limit": workers[0].get("limit"),  # the fast tier's admission limit (first worker's; None: none)
                "queue_target": workers[0].get("queue_target"),
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


def _usage_now(proxy_pid: int) -> dict[str, dict[int, tuple[float, float]]]:
    """(CPU seconds, CPU wait seconds) so far: this process's (the client's), and the proxy's and its descendants'."""
    me = os.getpid()
    return {"client": {me: (cpu_seconds(me), runqueue_wait_seconds(me))}, "proxy": tree_usage(proxy_pid)}


def _role(pid: int) -> str:
    """A descendant of the proxy: one of its ``planner``'s processes (``multiprocessing``) or a ``workers``'."""
    try:
        spawned = b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        spawned = False
    return "planner" if spawned else "workers"


def _cpu_used(
    before: dict[str, dict[int, tuple[float, float]]],
    after: dict[str, dict[int, tuple[float, float]]],
    proxy_pid: int,
    wall_s: float,
) -> dict[str, dict[str, float]]:
    """Per role, the CPU cores it used over ``wall_s`` and the share of it its threads waited for a CPU
    (summed over its threads and processes): ``client`` (this process), ``proxy``, and the proxy's
    descendants, ``workers`` and ``planner`` (its processes); one started meanwhile counts whole,
    one that ended takes its figures with it."""
    sums: dict[str, list[float]] = {}
    for tree in ("client", "proxy"):
        for pid, (cpu, wait) in after[tree].items():
            role = tree if tree == "client" or pid == proxy_pid else _role(pid)
            cpu0, wait0 = before[tree].get(pid, (0.0, 0.0))
            got = sums.setdefault(role, [0.0, 0.0])
            got[0] += max(0.0, cpu - cpu0)
            got[1] += max(0.0, wait - wait0)
    wall_s = max(wall_s, 1e-9)
    return {role: {"cores": round(c / wall_s, 3), "cpu_wait": round(w / wall_s, 3)} for role, (c, w) in sums.items()}


async def _read_end(session: Any, url: str, res: ArmResult, proxy: ProxyProcess) -> None:
    """What the proxy says at the end of an arm: its decisions, the workers' restarts, arguments and
    output budgets, the continuations past a budget, and its peak memory."""
    res.decisions = (await _get_json(session, url + "/admin/decisions"))["decisions"]
    workers = (await _get_json(session, url + "/admin/workers"))["workers"]
    res.restarts = sum(int(w["restarts"]) for w in workers)
    res.final_args = dict(workers[0]["args"]) if len(workers) == 1 else {w["id"]: w["args"] for w in workers}
    res.output_budgets = {w["id"]: w.get("output_budget") for w in workers}
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pacer_output_budget_continuations_total")]  # fmt: skip
    res.continuations = sum(counts) if counts else None
    res.proxy_peak_rss_mb = proxy.peak_rss_mb()
    res.planner_peak_rss_mb = proxy.planner_peak_rss_mb()


async def _wait_ready(session: Any, url: str, failure: str, timeout_s: float = 300.0) -> None:
    """Until the proxy is ready and every worker of it is up and scraped (else ``RuntimeError(failure)``)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200:
                    states = [w["state"] for w in (await _get_json(session, url + "/admin/workers"))["workers"]]
                    if all(x == "ready" for x in states):
                        return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        await asyncio.sleep(0.2)


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
    pacing: Mapping[str, Any] | None = None,
) -> ArmResult:
    """One arm, end to end: start the proxy, submit the workload (and ``trial``, an operator's, at its
    moment), follow it, stop, count. ``control``: the arm's ``[control]`` keys (None: the shipped ones);
    ``pacing``: its ``[pacing]`` (None: the scenarios' :data:`~loadtests.scenario_proxy.PACING`)."""
    import aiohttp

    workdir = Path(workdir).resolve()  # the proxy runs there: the policy's paths must not be relative
    workdir.mkdir(parents=True, exist_ok=True)
    for old in (workdir / "logs").glob("*.log"):  # worker logs are appended: a re-run in the same workdir
        old.unlink()  # would count the earlier run's retractions and OOMs too
    policy = workdir / "policy.toml"
    policy.write_text(policy_toml(sc, args, mode, workdir, worker_args, control, pacing))
    res = ArmResult(
        arm=arm, args={k: v for k, v in args.items() if v is not None}, control_mode=mode, time_scale=sc.time_scale
    )
    requests = sc.workload.requests()
    proxy = ProxyProcess(policy, workdir / "proxy.log", cwd=workdir)
    url = await proxy.start()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
            await _wait_ready(session, url, f"{sc.name}/{arm}: the proxy never became ready; see {workdir}")
            model = (await _get_json(session, url + "/v1/models"))["data"][0]["id"]
            counters: dict[str, _Counter] = {}
            stop = asyncio.Event()
            load_start = os.getloadavg()[0]
            assert proxy.proc is not None
            usage_start = _usage_now(proxy.proc.pid)
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
            res.cpu = _cpu_used(usage_start, _usage_now(proxy.proc.pid), proxy.proc.pid, time.monotonic() - t0)
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
            await _read_end(session, url, res, proxy)
    finally:
        await proxy.stop()
    res.retractions, res.oom_crashes = _count_log(workdir / "logs")
    return res
