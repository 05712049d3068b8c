"""A pool's shape: 8 simulated H100s serving an 8B model as one tp-8 worker, reshaped by the controller.

    python -m loadtests reshape [--concurrency 1024 --measure 60 --time-scale 1 --json out.json]

The oracle: every shape of the 8 GPUs (8 x tp 1, 4 x tp 2, 2 x tp 4, 1 x tp 8) serving the scenario's
requests in virtual time (:func:`proxy.sim.virtual.simulate`, the engine the live workers run), as a
backlog dealt to the replicas in turn: the best shape in hindsight. Two live arms, each a ``pacer serve``
managing its simulated workers under a closed loop of ``--concurrency`` clients (more than the pool
runs at once, so work waits in the proxy's queue, as for a backlog):

* ``best``: the oracle's best shape, control off: its output tokens per second over ``--measure``
  seconds once a request's lifetime has passed (the workers' generation counters);
* ``auto``: one tp-8 worker, control auto with ``reshape = true``: the journal's first ``reshape``
  entry is the advice (the better shape, its predicted gain); once the reshape is applied and a
  lifetime has passed, the pool's throughput over ``--measure`` seconds, as above.

Targets: the advice names a shape that serves >= 0.95 x the oracle's best in hindsight; the auto arm
reaches >= 0.95 x the best arm's throughput; no request fails (nothing lost). Every request asks for
``--output`` tokens (``sim_output_len``) after a prompt of ``--prompt`` tokens no other prompt shares.

Sizing (2 cores): whole answers, not streams, so the proxy relays one response per request; at the
defaults the pool answers some 30-40 requests a second. Each worker caps its running requests at
96 per GPU (``max_running_requests = 768`` for the tp-8 worker, scaled per GPU by a reshape): the
pool runs about 768 requests at once, not the thousands its KV pools hold, which a 2-core client and
proxy could not keep open. The workers' start-up is ``--startup`` wall seconds (not the modelled
weights load): the reshape's cost is then its drain and that start-up. The controller's constants are
the shipped ones: its first look at the shape after ``min_evidence_s``, a reshape on the second look
``plan_interval_s`` later. About 5-6 wall minutes at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from loadtests.procs import start_pacer
from proxy.control.shape import Shape, shape_args, shapes_for
from proxy.control.twin import Twin
from proxy.sim.request import RequestSpec
from proxy.sim.twin import TWIN_ENGINE
from proxy.sim.virtual import simulate

MODEL = "reshape-model"
TARGET = 0.95


def policy(shape: Shape, args: argparse.Namespace, *, auto: bool, log_dir: Path) -> str:
    extra = ["--sim-gpu", args.gpu, "--sim-model", args.model, "--sim-time-scale", f"{args.time_scale:g}",
             "--sim-startup-seconds", f"{args.startup:g}"]  # fmt: skip
    control = {"mode": "auto", "reshape": True} if auto else {"mode": "off"}
    return tomli_w.dumps({
        "proxy": {"host": "127.0.0.1", "status_log_interval_s": 60.0, "gpu_sample_interval_s": 0},
        "queue": {"capacity": 100000, "timeout_s": 600.0},
        "pool": [{"name": "p", "model": MODEL, "kind": "sim", "tp": shape.tp, "gpus": list(range(args.gpus)),
                  "args": {"max_running_requests": args.cap_per_gpu * shape.tp}, "extra_args": extra,
                  "log_dir": str(log_dir / "workers"), "startup_timeout_s": 120,
                  "control": control}],
        "control": {"journal_path": str(log_dir / "decisions.jsonl")},
    })  # fmt: skip


def prompt(i: int, tokens: int) -> str:
    """``tokens`` tokens (the simulator's: up to 4 characters each) whose first no other prompt has."""
    return " ".join([f"q{i % 9999}", *(["word"] * (tokens - 1))])


def oracle(args: argparse.Namespace) -> dict[Shape, float]:
    """Each shape's output tokens per (wall) second on a backlog of the scenario's requests, in virtual time."""
    twin = Twin(args.gpu, args.model)
    base = {"max_running_requests": args.cap_per_gpu * args.gpus}
    n = 4 * args.cap_per_gpu * args.gpus  # four pools' worth of running requests: fill and drain weigh little
    out: dict[Shape, float] = {}
    for shape in shapes_for(args.gpus):
        cfg = twin.config(shape_args(base, args.gpus, shape.tp, TWIN_ENGINE.placement_args(shape.tp, None)))
        per = n // shape.workers
        specs = [RequestSpec(arrival=0.0, prompt_len=args.prompt, max_new_tokens=args.output, output_len=args.output)
                 for _ in range(per)]  # fmt: skip
        res = simulate(cfg, specs)  # the replicas are alike and so are their shares: one stands for all
        out[shape] = res.output_tokens * shape.workers / res.makespan_s * args.time_scale  # wall seconds
    return out


async def _client(
    session: aiohttp.ClientSession,
    url: str,
    i: int,
    args: argparse.Namespace,
    tally: dict[str, Any],
    stop: asyncio.Event,
) -> None:
    k = i
    while not stop.is_set():
        body = {"model": MODEL, "prompt": prompt(k, args.prompt), "max_tokens": args.output,
                "sim_output_len": args.output}  # fmt: skip
        k += args.concurrency
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                doc = await r.json()
                if r.status != 200 or doc["usage"]["completion_tokens"] != args.output:
                    tally["errors"].append(f"HTTP {r.status}: {str(doc)[:200]}")
                else:
                    tally["answered"] += 1
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError) as exc:
            tally["errors"].append(repr(exc))


async def _generated(session: aiohttp.ClientSession, url: str) -> float:
    """The pool's output tokens so far: every worker's generation counter."""
    async with session.get(url + "/admin/workers") as r:
        workers = (await r.json())["workers"]
    total = 0.0
    for w in workers:
        async with session.get(w["url"] + "/metrics") as m:
            for line in (await m.text()).splitlines():
                if line.startswith("sglang:generation_tokens_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def _rate(session: aiohttp.ClientSession, url: str, seconds: float) -> float:
    before, t0 = await _generated(session, url), time.monotonic()
    await asyncio.sleep(seconds)
    return (await _generated(session, url) - before) / (time.monotonic() - t0)


async def _reshaped(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The first reshape entry (the advice) and the one carried out, once it is applied or failed."""
    deadline, advice = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        async with session.get(url + "/admin/decisions") as r:
            entries = [e for e in (await r.json())["decisions"] if e["rule"] == "reshape"]
        advice = advice or next(iter(sorted(entries, key=lambda e: e["id"])), None)
        done = [e for e in entries if e["status"] in ("applied", "failed")]
        if done:
            return advice, done[0]
        await asyncio.sleep(1.0)
    return advice, None


async def _arm(url: str, args: argparse.Namespace, auto: bool) -> dict[str, Any]:
    tally: dict[str, Any] = {"answered": 0, "errors": []}
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        clients = [asyncio.create_task(_client(session, url, i, args, tally, stop)) for i in range(args.concurrency)]
        out: dict[str, Any] = {}
        if auto:
            out["advice"], out["reshape"] = await _reshaped(session, url, args.reshape_timeout)
        await asyncio.sleep(args.settle)
        out["tok_per_s"] = round(await _rate(session, url, args.measure), 1)
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    out.update(answered=tally["answered"], errors=len(tally["errors"]), first_error=(tally["errors"] or [None])[0])
    return out


def run(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    out_dir = Path(args.out_dir)
    truth = oracle(args)
    best = max(truth, key=truth.__getitem__)
    say("oracle: " + ", ".join(f"{s} {v:.0f} tok/s" for s, v in truth.items()) + f"; best {best}")
    arms: dict[str, Any] = {}
    for name, shape, auto in (("best", best, False), ("auto", Shape(args.gpus, 1), True)):
        log_dir = out_dir / name
        log_dir.mkdir(parents=True, exist_ok=True)
        text = policy(shape, args, auto=auto, log_dir=log_dir)
        with start_pacer(log_dir, [], name=f"pacer-{name}", policy_text=text, timeout_s=180) as proc:
            arms[name] = asyncio.run(_arm(proc.url, args, auto))
        say(
            f"{name}: {arms[name]['tok_per_s']} tok/s, {arms[name]['answered']} answered, {arms[name]['errors']} errors"
        )
    return report(truth, best, arms)


def report(truth: dict[Shape, float], best: Shape, arms: dict[str, Any]) -> dict[str, Any]:
    advice = arms["auto"].get("advice") or {}
    named = next((s for s in truth if str(s) == advice.get("best_shape")), None)
    reshape = arms["auto"].get("reshape") or {}
    return {
        "oracle_tok_per_s": {str(s): round(v, 1) for s, v in truth.items()},
        "oracle_best": str(best),
        "advice_best_shape": advice.get("best_shape"),
        "advice_predicted_gain": advice.get("predicted_gain"),
        "advice_vs_oracle_best": round(truth[named] / truth[best], 4) if named is not None else None,
        "reshape_status": reshape.get("status"),
        "best_arm_tok_per_s": arms["best"]["tok_per_s"],
        "auto_arm_tok_per_s": arms["auto"]["tok_per_s"],
        "auto_vs_best": round(arms["auto"]["tok_per_s"] / arms["best"]["tok_per_s"], 4)
        if arms["best"]["tok_per_s"]
        else None,
        "errors": arms["best"]["errors"] + arms["auto"]["errors"],
        "arms": arms,
        "target": TARGET,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtests reshape", description=__doc__)
    ap.add_argument(
        "--gpus", type=int, default=8, help="the pool's simulated GPUs (the auto arm: one worker at tp = this)"
    )
    ap.add_argument("--gpu", default="h100-80gb", help="the simulator's --sim-gpu")
    ap.add_argument("--model", default="llama-3.1-8b", help="the simulator's --sim-model")
    ap.add_argument("--cap-per-gpu", type=int, default=96, help="max_running_requests per GPU")
    ap.add_argument("--concurrency", type=int, default=1024, help="clients (more than the pool runs at once)")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens of each request")
    ap.add_argument("--output", type=int, default=1024, help="output tokens of each request")
    ap.add_argument("--time-scale", type=float, default=1.0, help="the simulator's --sim-time-scale")
    ap.add_argument("--startup", type=float, default=5.0, help="each worker's start-up, wall seconds")
    ap.add_argument("--settle", type=float, default=30.0, help="wall seconds before measuring (a request's life)")
    ap.add_argument("--measure", type=float, default=60.0, help="wall seconds each arm's throughput is measured over")
    ap.add_argument("--reshape-timeout", type=float, default=400.0, help="wall seconds the auto arm waits for it")
    ap.add_argument("--out-dir", default=".pacer/loadtests/reshape")
    ap.add_argument("--json", help="write the report here")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = run(args)
    print(f"oracle best {out['oracle_best']}; advice {out['advice_best_shape']} (predicted gain "
          f"{out['advice_predicted_gain']}), {out['advice_vs_oracle_best']} x the best in hindsight")  # fmt: skip
    print(f"auto {out['auto_arm_tok_per_s']} tok/s vs best {out['best_arm_tok_per_s']} tok/s: {out['auto_vs_best']}"
          f" (target >= {TARGET}); reshape {out['reshape_status']}; errors {out['errors']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
