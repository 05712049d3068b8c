"""SGLang's scheduling policy: which requests to admit, chunk or retract. It decides; the engine acts.

* **Queue.** Waiting requests in arrival order, sorted per round by ``--schedule-policy``: ``lpm``
  (longest cached prefix first; fcfs above 128 waiting, as SGLang; SGLang's in-batch prefix caching:
  a request with at most 32 tokens cached whose first 32 tokens another waiting request ahead of it
  brings goes last this round, so the shared prefix is computed once; the round's CPU time is kept in
  :attr:`Scheduler.cpu_s` for the engine to charge), ``lof`` (largest ``max_new_tokens`` first),
  ``random``, else fcfs.
* **Priority** (``--enable-priority-scheduling``, SGLang 0.5.x): ``fcfs`` orders by (priority, time
  queued), ``lof`` by (priority, largest ``max_new_tokens``); a request sent without one gets the
  lowest. When the running batch is full, the head of the queue preempts running requests more than
  ``--priority-scheduling-preemption-threshold`` below it, least important and latest first, until
  it fits (:meth:`Scheduler.preemptible`, SGLang's ``PrefillAdder.preempt_to_schedule``), unless
  ``--disable-priority-preemption``; the preempted go back to the queue as retracted ones do.
* **Prefill.** :meth:`Scheduler.next_prefill` asks :func:`~proxy.sim.prefill_adder.admit` for the
  next batch. A batch found *full* stays full until a request leaves the running batch
  (:meth:`Scheduler.batch_changed`).
* **new_token_ratio** (:mod:`proxy.sim.ratio`): decays on each decode step that fits, resets when
  idle, is re-estimated after a retraction.
* **Retraction.** When the next decode step's tokens do not fit, the running requests with the
  fewest output tokens (ties: longest prompt) go back to the queue until 20 steps of the rest fit;
  one is always kept (:meth:`Scheduler.retract`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

from proxy.engines.sglang.argv import LPM_QUEUE_LIMIT  # past it, SGLang's lpm serves the queue in arrival order
from proxy.sim.config import SimConfig
from proxy.sim.kv_pool import KvPool
from proxy.sim.prefill_adder import AdmitResult, admit
from proxy.sim.ratio import CLIP_MAX_NEW_TOKENS, RETRACT_DECODE_STEPS, RatioSchedule, ratio_after_retract
from proxy.sim.request import Req, State
from proxy.sim.steptime import lpm_round_seconds

# SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and _DEPRIORITIZE_THRESHOLD (schedule_policy.py)
IN_BATCH_CHECK = 32
IN_BATCH_DEPRIORITIZE = 32
LOWEST_PRIORITY_HIGH_FIRST = -sys.maxsize - 1  # what a request without a priority gets (SGLang's scheduler)
LOWEST_PRIORITY_LOW_FIRST = sys.maxsize


class Scheduler:
    __slots__ = (
        "_queued",
        "batch_is_full",
        "cfg",
        "chunked",
        "cpu_s",
        "priority_sign",
        "ratio",
        "ratio_schedule",
        "rng",
        "waiting",
        "waiting_tokens",
    )

    def __init__(self, config: SimConfig, rng: random.Random) -> None:
        self.cfg = config
        self.rng = rng  # shared with the engine's output-length draws: one stream, as before
        self.ratio_schedule = RatioSchedule.from_conservativeness(config.schedule_conservativeness)
        self.ratio = self.ratio_schedule.init
        self.waiting: list[Req] = []
        self.waiting_tokens = 0  # uncached input tokens waiting, roughly (#pending-token)
        self.chunked: Req | None = None  # the request whose prefill continues next round
        self.batch_is_full = False
        self.priority_sign = 1 if config.schedule_low_priority_values_first else -1  # sort key sign
        self._queued = 0  # queue entries so far: the order a request (re-)entered the queue
        self.cpu_s = 0.0  # scheduling CPU seconds not yet charged to a step (lpm's matching)

    # ------------------------------------------------------------------ queue
    def default_priority(self) -> int:
        """The priority of a request sent without one (the least important)."""
        return LOWEST_PRIORITY_LOW_FIRST if self.cfg.schedule_low_priority_values_first else LOWEST_PRIORITY_HIGH_FIRST

    def enqueue(self, r: Req) -> None:
        r.state = State.WAITING
        self._queued += 1
        r.queued_seq = self._queued
        self.waiting.append(r)
        self.waiting_tokens += len(r.fill_ids)

    def dequeue(self, r: Req) -> None:
        self.waiting.remove(r)
        self.waiting_tokens -= len(r.fill_ids)

    def queue_full(self) -> bool:
        cap = self.cfg.max_queued_requests
        return cap is not None and len(self.waiting) >= cap

    def batch_changed(self) -> None:
        """A request left the running batch: admission may find room again."""
        self.batch_is_full = False

    def _ordered_waiting(self, kv: KvPool) -> list[Req]:
        policy = self.cfg.schedule_policy
        sign = self.priority_sign
        if self.cfg.enable_priority_scheduling and policy == "fcfs":
            self.waiting.sort(key=lambda r: (r.priority * sign, r.queued_seq))
        elif self.cfg.enable_priority_scheduling and policy == "lof":
            self.waiting.sort(key=lambda r: (r.priority * sign, -r.max_new))
        elif policy == "lpm" and len(self.waiting) <= LPM_QUEUE_LIMIT and kv.cache.enabled:
            self._lpm_sort(kv)
        elif policy == "lof":
            self.waiting.sort(key=lambda r: -r.max_new)
        elif policy == "random":
            self.rng.shuffle(self.waiting)
        return self.waiting

    def _lpm_sort(self, kv: KvPool) -> None:
        """SGLang's lpm round (``_compute_prefix_matches`` and ``_sort_by_longest_prefix``): longest
        cached prefix first, the in-batch duplicates last; its CPU time goes to :attr:`cpu_s`. A
        request's match in the queue's tree reaches 32 tokens exactly when a request inserted before
        it starts with the same 32 tokens, so a set of those heads stands for that tree."""
        peek = kv.cache.peek
        heads: set[tuple[int, ...]] = set()
        keys: dict[int, float] = {}
        walked = 0
        for r in self.waiting:
            cached = peek(r.fill_ids)
            walked += cached
            keys[id(r)] = -cached
            if cached > IN_BATCH_CHECK:
                continue
            walked += len(r.fill_ids)  # its match and insert in the queue's tree
            head = tuple(r.fill_ids[:IN_BATCH_DEPRIORITIZE])
            if len(head) == IN_BATCH_DEPRIORITIZE and head in heads:
                keys[id(r)] = float("inf")
            else:
                heads.add(head)
        self.cpu_s += lpm_round_seconds(len(self.waiting), walked)
        self.waiting.sort(key=lambda r: keys[id(r)])

    def take_cpu_s(self) -> float:
        """The scheduling CPU seconds since the last call (charged to the step planned now)."""
        spent, self.cpu_s = self.cpu_s, 0.0
        return spent

    # ------------------------------------------------------------------ priority preemption
    def preemptible(self, kv: KvPool) -> list[Req]:
        """Running requests the head of the queue may preempt now (SGLang's ``preempt_to_schedule``):
        empty unless priority scheduling is on, the running batch is full, and enough of it is more
        than the threshold less important than the head for the head's tokens to fit."""
        cfg = self.cfg
        if not cfg.enable_priority_scheduling or cfg.disable_priority_preemption:
            return []
        if not self.waiting or self.chunked is not None:
            return []
        if kv.running.n < cfg.max_running_requests:
            return []
        sign = self.priority_sign
        running = kv.running
        head = min(self.waiting, key=lambda r: (r.priority * sign, r.queued_seq))  # the queue's head (fcfs)
        if self.cfg.schedule_policy == "lof":
            head = self._ordered_waiting(kv)[0]
        threshold = cfg.priority_scheduling_preemption_threshold
        if all((head.priority - r.priority) * -sign <= threshold for r in running.reqs):
            return []  # the common case (a queue of equals) in one pass, before any sorting
        order = sorted(running.reqs, key=lambda r: (r.priority * -sign, -r.queued_seq))
        budget = kv.free - running.reservation(self.ratio)
        to_free = len(head.fill_ids) + min(head.max_new, CLIP_MAX_NEW_TOKENS) - budget
        chosen: list[Req] = []
        for r in order:
            if (head.priority - r.priority) * -sign <= threshold:
                break
            chosen.append(r)
            to_free -= min(r.max_new - running.output_len(r), CLIP_MAX_NEW_TOKENS) * self.ratio
            if to_free <= 0:
                break
        return chosen if chosen and to_free <= 0 else []

    # ------------------------------------------------------------------ prefill
    def next_prefill(self, kv: KvPool) -> AdmitResult | None:
        """The next prefill batch, its new requests taken off the queue; None when nothing is admitted."""
        n_run = kv.running.n
        if n_run == 0:
            self.batch_is_full = False  # an empty running batch is never full
        if self.chunked is None and (self.batch_is_full or not self.waiting):
            return None
        allocatable = self.cfg.max_running_requests - n_run
        if allocatable <= 0:
            self.batch_is_full = True
            return None
        result = admit(
            self.cfg,
            kv,
            kv.running.reservation(self.ratio),
            self.chunked,
            self._ordered_waiting(kv) if self.waiting else [],
            allocatable,
        )
        if result.batch_full:
            self.batch_is_full = True
        if not result.items:
            return None
        # The admitted requests are a prefix of the (ordered) queue.
        n_new = sum(1 for it in result.items if it.new)
        if n_new:
            for r in self.waiting[:n_new]:
                self.waiting_tokens -= len(r.fill_ids)
            del self.waiting[:n_new]
        self.chunked = next((it.req for it in result.items if not it.last), None)
        return result

    # ------------------------------------------------------------------ decode
    def idle(self) -> None:
        self.ratio = self.ratio_schedule.init

    def decode_fits(self, kv: KvPool) -> bool:
        """Whether the next decode step's tokens fit; if so the ratio decays one step."""
        if kv.running.n > kv.free:
            return False
        self.ratio = self.ratio_schedule.decayed(self.ratio)
        return True

    def retract(self, kv: KvPool, take_out: Callable[[Req], None]) -> list[Req]:
        """Pick requests to retract, fewest output tokens first, until 20 decode steps of the rest fit;
        ``take_out`` frees each one (so ``kv.free`` grows). Returns them, in retraction order."""
        running = kv.running
        order = sorted(running.reqs, key=lambda r: (running.output_len(r), -r.prompt_len))
        retracted: list[Req] = []
        keep = len(order)
        while keep > 1 and (not retracted or kv.free < RETRACT_DECODE_STEPS * keep):
            r = order[len(retracted)]
            retracted.append(r)
            keep -= 1
            take_out(r)
        return retracted

    def after_retract(self, kv: KvPool) -> None:
        running = kv.running
        outs = [running.output_len(r) for r in running.reqs]
        self.ratio = ratio_after_retract(sum(outs), len(outs), sum(r.max_new for r in running.reqs))
        self.batch_is_full = False
