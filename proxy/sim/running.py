"""The running batch: the requests that decode, with their output and KV counts kept lazily.

A decode step adds one token to every running request. Counting that per request would cost
O(batch) a step; instead the batch keeps a decode-step counter ``g`` and, per request, the counter
at which it joined (``step_base``)::

    output tokens of r      = r.out_base + g - r.step_base
    decode KV of the batch  = n x g - sum(step_base)

so a step costs O(1). Running sums give the batch's KV tokens, its private (uncached) KV and the
tokens it is expected still to need (its *reservation*, split by ``ignore_eos``; requests whose
``max_new_tokens`` exceeds the clip are summed one by one, since their remaining count is clipped).
A heap of (finishing step, seq) finds who finishes at a step without scanning the batch.
"""

from __future__ import annotations

import heapq

from proxy.sim.ratio import CLIP_MAX_NEW_TOKENS
from proxy.sim.request import Req, State


class RunningBatch:
    __slots__ = (
        "_big",
        "_finish_heap",
        "_res_max",
        "_res_n",
        "_res_outb",
        "_sum_private_base",
        "_sum_seq_base",
        "_sum_step_base",
        "g",
        "n",
        "reqs",
    )

    def __init__(self) -> None:
        self.reqs: list[Req] = []
        self.n = 0
        self.g = 0  # decode steps so far
        self._sum_step_base = 0
        self._sum_seq_base = 0  # sum(prompt + out_base - 1 - step_base): KV tokens = this + n x g
        self._sum_private_base = 0
        # Reservation sums per group (0 = may stop by EOS, 1 = ignore_eos); big requests apart.
        self._res_n = [0, 0]
        self._res_max = [0, 0]
        self._res_outb = [0, 0]  # sum(out_base - step_base)
        self._big: dict[Req, None] = {}  # insertion-ordered: sums stay deterministic
        self._finish_heap: list[tuple[int, int, Req]] = []

    def output_len(self, r: Req) -> int:
        if r.state is State.RUNNING:
            return r.out_base + self.g - r.step_base
        return r.out_base

    @property
    def private_tokens(self) -> int:
        """KV tokens the running requests own outside the prefix cache."""
        return self._sum_private_base + self.n * self.g - self._sum_step_base

    @property
    def kv_tokens(self) -> int:
        """KV tokens of the running requests' sequences (prompt and outputs)."""
        return self._sum_seq_base + self.n * self.g

    def reservation(self, ratio: float) -> float:
        """Tokens the batch is expected still to need: remaining max_new x ratio (x 1 with ignore_eos)."""
        g = self.g
        rem_eos = self._res_max[0] - self._res_outb[0] - self._res_n[0] * g
        rem_ign = self._res_max[1] - self._res_outb[1] - self._res_n[1] * g
        total = rem_eos * ratio + rem_ign
        for r in self._big:
            rem = min(r.max_new - self.output_len(r), CLIP_MAX_NEW_TOKENS)
            total += rem * (1.0 if r.ignore_eos else ratio)
        return total

    def join(self, r: Req) -> None:
        r.state = State.RUNNING
        r.step_base = self.g
        self.reqs.append(r)
        self.n += 1
        self._sum_step_base += r.step_base
        self._sum_seq_base += r.prompt_len + r.out_base - 1 - r.step_base
        self._sum_private_base += r.private_base
        if r.big:
            self._big[r] = None
        else:
            grp = 1 if r.ignore_eos else 0
            self._res_n[grp] += 1
            self._res_max[grp] += r.max_new
            self._res_outb[grp] += r.out_base - r.step_base
        r.finish_g = self.g + (r.target - r.out_base)
        heapq.heappush(self._finish_heap, (r.finish_g, r.seq, r))

    def leave(self, r: Req) -> None:
        """Freeze its output count and its private KV (decode tokens included) into the request and
        drop it from the sums; the caller takes it off ``reqs`` and sets its next state."""
        r.out_base = self.output_len(r)
        decode_private = self.g - r.step_base
        self.n -= 1
        self._sum_step_base -= r.step_base
        self._sum_seq_base -= r.prompt_len + (r.out_base - decode_private) - 1 - r.step_base
        self._sum_private_base -= r.private_base
        if r.big:
            del self._big[r]
        else:
            grp = 1 if r.ignore_eos else 0
            self._res_n[grp] -= 1
            self._res_max[grp] -= r.max_new
            self._res_outb[grp] -= (r.out_base - decode_private) - r.step_base
        r.private_base += decode_private
        r.state = State.PREFILLING  # transient; the caller sets the real state

    def drop(self, gone: set[Req]) -> None:
        """Take these requests off ``reqs`` (order of the rest kept)."""
        self.reqs = [r for r in self.reqs if r not in gone]

    def advance(self) -> list[Req]:
        """One decode step: every running request gains a token. Returns those whose output is now
        complete, in finishing order (still in the batch: the caller makes them leave)."""
        self.g += 1
        g = self.g
        heap = self._finish_heap
        done: dict[Req, None] = {}  # a request retracted and back within one step has two entries here
        while heap and heap[0][0] <= g:
            fg, _, r = heapq.heappop(heap)
            if r.state is State.RUNNING and r.finish_g == fg:
                done[r] = None
        return list(done)
