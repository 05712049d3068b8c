"""The budget benchmark's workloads in virtual time, through the proxy's own gate and fast tier.

    python -m loadtests.budget_replay [--workload bursty|mix] [--arm budget|no-budget|off] [--trace FILE]

:func:`replay` drives one simulated engine (:class:`proxy.sim.engine.Engine`, no sockets, no
sleeping) as the proxy would: the requests wait in a queue in front of it and go while the worker
has room under the fast tier's admission limit and its estimated server queue is under the target
(:class:`proxy.request.pacing.WorkerLoad`, the same code); every scrape interval the fast tier
(:class:`proxy.control.fast_decision.FastTier`, the same code, fed what the request path would feed
it) sets the limit, the queue target and the output budget; a request is sent at its budget and an
answer that reaches it is continued at once on the same worker. What it leaves out: the slow tier
(no restarts), CPU, the network. A few seconds of CPU where a live arm takes minutes, so a design
can be tried on it before a live run, and each request's times and the fast tier's moves are kept
for a look at why a tail is what it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.budget import WORKLOADS, arm_control, long_answers, workloads
from loadtests.oracle import sim_config
from loadtests.scenario_defs import Scenario
from loadtests.scenario_proxy import shipped_pacing
from proxy.compose_fast_tier import load_reading
from proxy.control.fast_decision import FastTier
from proxy.control.fast_tier import PaceSettings
from proxy.engines.base import Sample
from proxy.policy_settings import ControlSettings
from proxy.request.admission import Priority
from proxy.request.continuation import MIN_SAVING, applies_above
from proxy.request.facts import RequestFact
from proxy.request.pacing import Band, WorkerLoad
from proxy.sim.engine import Engine
from proxy.sim.request import Req

__all__ = ["Replayed", "replay"]


@dataclass(frozen=True, slots=True)
class _Ticket:
    priority: Priority
    enqueued_at: float


@dataclass(eq=False, slots=True)
class _Open:
    """One request the replay has sent: what :class:`WorkerLoad` holds as its attempt."""

    index: int
    ticket: _Ticket
    dispatched: float
    sent_max: int | None  # the budget it went under (None: as asked)
    first_token: float | None = None
    written: int = 0
    parts: int = 1
    seam_s: float = 0.0  # engine seconds its later parts waited for their first token (the continuations' wait)


@dataclass(slots=True)
class Replayed:
    """Per request (workload index): arrival, dispatch, first token and answer, engine seconds, its
    parts and how long the later ones waited for their first token; the fast tier's moves (time, limit, queue target, budget) and the engine's trace (time, waiting,
    running, proxy queue)."""

    arrival: list[float]
    dispatched: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)
    seam_s: list[float] = field(default_factory=list)
    moves: list[tuple[float, int | None, int | None, int | None]] = field(default_factory=list)
    trace: list[tuple[float, int, int, int]] = field(default_factory=list)

    def summary(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        chosen = range(len(self.arrival)) if indices is None else indices
        ttft = sorted(self.first_token[i] - self.arrival[i] for i in chosen)
        e2e = sorted(self.answered[i] - self.arrival[i] for i in chosen)

        def q(v: list[float], p: float) -> float:
            return round(v[max(0, math.ceil(p * len(v)) - 1)], 3) if v else math.nan

        after = sorted(self.answered[i] - self.first_token[i] for i in chosen)
        seams = sorted(self.seam_s[i] for i in chosen if self.parts[i] > 1)
        return {"ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99), "e2e_p50_s": q(e2e, 0.5),
                "e2e_p99_s": q(e2e, 0.99), "after_first_p50_s": q(after, 0.5), "after_first_p99_s": q(after, 0.99),
                "last_answer_s": round(max(self.answered[i] for i in chosen), 2),
                "continued": len(seams), "seam_wait_p50_s": q(seams, 0.5), "seam_wait_p99_s": q(seams, 0.99)}  # fmt: skip


class _Admission:
    """What the fast tier reads of the proxy's queue: its length and its interactive depth."""

    def __init__(self, queue: deque[int]) -> None:
        self._queue = queue

    def __len__(self) -> int:
        return len(self._queue)

    def depth(self, priority: Priority) -> int:
        return len(self._queue) if priority is Priority.INTERACTIVE else 0


def _prompt(index: int, length: int) -> tuple[int, ...]:
    base = -(index + 1) * 10_000_000
    return tuple(range(base, base + max(1, length)))


class _Replay:
    def __init__(self, sc: Scenario, arm: str, scrape_s: float, settings: PaceSettings | None) -> None:
        mode, control = arm_control(arm)
        pacing = shipped_pacing()
        lo, hi = pacing["queue_band"]
        self.band = Band(lo=lo, hi=hi, headroom=int(pacing.get("headroom", 32)))
        self.scrape_s = scrape_s
        self.eng = Engine(sim_config(sc.start_args, gpu=sc.gpu, model=sc.model))
        self.load = WorkerLoad("w0")
        self.tier: FastTier | None = None
        if mode == "auto":
            own = settings or PaceSettings.of(
                ControlSettings(output_budget=bool(control.get("output_budget", True))), interactive_window_s=5.0
            )
            self.tier = FastTier(own, lo=lo, hi=hi, headroom=self.band.headroom, applies_above=applies_above)
        self.requests = sc.workload.requests()
        arrivals = sc.workload.arrivals()
        self.out = Replayed(arrival=list(arrivals))
        n = len(arrivals)
        self.out.dispatched, self.out.first_token = [math.nan] * n, [math.nan] * n
        self.out.answered, self.out.parts, self.out.seam_s = [math.nan] * n, [1] * n, [0.0] * n
        self.todo = sorted(range(n), key=lambda i: (arrivals[i], i), reverse=True)
        self.queue: deque[int] = deque()
        self.on_engine: dict[str, tuple[_Open, Req]] = {}

    def scrape(self, t: float) -> None:
        eng, load = self.eng, self.load
        load.scrape_started()
        sample = Sample(time=t, queue=len(eng.waiting), running=eng.n_run, token_usage=eng.token_usage,
                        retractions_total=float(eng.retracted_total), generation_tokens_total=float(eng.generated_tokens),
                        max_total_tokens=eng.pool)  # fmt: skip
        load.record(sample)
        if self.tier is None:
            return
        decision = self.tier.decide("w0", sample, load_reading(self.tier, "w0", sample, load, _Admission(self.queue)))  # type: ignore[arg-type]
        load.limit, load.queue_target = decision.limit, decision.queue_target
        for move in decision.budgets:
            key = (move.interactive, move.asked)
            if move.overrun:
                load.output_budgets.lift_as_overrun(key, t)
            else:
                load.output_budgets.set(key, move.tokens, t)
        self.out.moves.append((t, decision.limit, decision.queue_target, load.output_budgets.get((True, 4096))))

    def dispatch(self, t: float) -> None:
        load = self.load
        while self.todo and self.out.arrival[self.todo[-1]] <= t:
            self.queue.append(self.todo.pop())
        while self.queue and load.has_room(t) and load.est_queue() < load.target(self.band):
            i = self.queue.popleft()
            _, asked, _ = self.requests[i]
            budget = load.output_budget(interactive=True, max_tokens=asked)
            sent = budget if budget is not None and budget <= asked * (1 - MIN_SAVING) else None
            attempt = _Open(i, _Ticket(Priority.INTERACTIVE, self.out.arrival[i]), t, sent)
            load.reserve(attempt)  # type: ignore[arg-type]
            self.out.dispatched[i] = t
            self._send(attempt, t, sent or asked)

    def _send(self, attempt: _Open, t: float, cap: int) -> None:
        text, _, true_len = self.requests[attempt.index]
        prompt = _prompt(attempt.index, len(text.split()) + attempt.written)
        req = self.eng.add(prompt_ids=prompt, max_new_tokens=cap, output_len=true_len - attempt.written, now=t)
        self.on_engine[req.rid] = (attempt, req)

    def finished(self, req: Req, t: float) -> None:
        attempt, _ = self.on_engine.pop(req.rid)
        i = attempt.index
        if attempt.first_token is None:
            attempt.first_token = req.first_token_time
            self.out.first_token[i] = req.first_token_time or t
        else:  # a continuation: how long it waited at the worker for its first token
            attempt.seam_s += (req.first_token_time or t) - req.arrival
        attempt.written += self.eng.output_len(req)
        _, asked, true_len = self.requests[i]
        if attempt.sent_max is not None and attempt.written < min(asked, true_len):  # reached its cap: goes on
            if attempt.parts == 1:
                self.load.output_budgets.note_reached((True, asked), t)
            attempt.parts += 1
            budget = self.load.output_budget(interactive=True, max_tokens=asked) or asked
            self._send(attempt, t, max(1, min(asked - attempt.written, max(budget, attempt.written))))
            return
        self.out.answered[i], self.out.parts[i], self.out.seam_s[i] = t, attempt.parts, attempt.seam_s
        self.load.facts.record(RequestFact(time=t, arrived=self.out.arrival[i], prompt_tokens=req.prompt_len,
                                           output_tokens=attempt.written, max_tokens=asked, finish_reason="stop",
                                           ttft_s=(attempt.first_token or t) - attempt.dispatched,
                                           queue_s=attempt.dispatched - self.out.arrival[i],
                                           sent_max_tokens=attempt.sent_max, parts=attempt.parts))  # fmt: skip
        self.load.release(attempt)  # type: ignore[arg-type]


def replay(sc: Scenario, arm: str, *, scrape_s: float = 0.5, settings: PaceSettings | None = None) -> Replayed:
    """``sc``'s workload through the arm's proxy in front of one simulated engine, in engine seconds
    (time scale 1; ``scrape_s``: the policy's scrape interval); ``settings``: the fast tier's, to try
    a design (None: the arm's, from its ``[control]``)."""
    r = _Replay(sc, arm, scrape_s, settings)
    t, next_scrape = 0.0, 0.0
    while True:
        if t >= next_scrape:
            r.scrape(t)
            next_scrape = t + scrape_s
        r.dispatch(t)
        step = r.eng.plan(t)
        if step is None:
            if not r.todo and not r.queue and not r.on_engine:
                break
            t = min(next_scrape, r.out.arrival[r.todo[-1]] if r.todo else math.inf)
            continue
        t += step.duration
        outcome = r.eng.complete(step, t)
        r.out.trace.append((t, len(r.eng.waiting), r.eng.n_run, len(r.queue)))
        for req in outcome.finished:
            r.finished(req, t)
    return r.out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.budget_replay", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="bursty", choices=list(WORKLOADS))
    p.add_argument("--arms", default="budget,no-budget,off")
    p.add_argument("--count", type=int, default=2000, help="requests (the mix: 1 in 200 long)")
    p.add_argument("--rate", type=float, default=7.0, help="requests per modelled second")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(200, 600), metavar=("LO", "HI"), help="prompt tokens")
    p.add_argument("--trace", default=None, help="write each arm's requests, moves and trace here (JSON)")
    ns = p.parse_args(argv)
    sc = workloads(ns.count, ns.rate, prompt_len=tuple(ns.prompt_len))[ns.workload]
    long = long_answers(sc)
    kept: dict[str, Any] = {}
    for arm in ns.arms.split(","):
        out = replay(sc, arm)
        print(arm, json.dumps(out.summary()), "long answers:" if long else "",
              json.dumps(out.summary(long)) if long else "", flush=True)  # fmt: skip
        kept[arm] = {"summary": out.summary(), "arrival": out.arrival, "dispatched": out.dispatched,
                     "first_token": out.first_token, "answered": out.answered, "parts": out.parts, "seam_s": out.seam_s,
                     "moves": out.moves, "trace": out.trace}  # fmt: skip
    if ns.trace:
        with open(ns.trace, "w") as f:
            json.dump(kept, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
