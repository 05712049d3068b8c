"""Requests: the frozen spec a workload or an HTTP call gives, and the engine's mutable state of one.

The true output length is the simulated model's: a request stops by EOS after ``target`` tokens,
unless ``max_new_tokens`` comes first (``ignore_eos`` always runs to ``max_new_tokens``). It is the
request's ``output_len`` when given (``sim_output_len`` over HTTP), else drawn from the server's
distribution::

    fraction ~ Uniform(F - S, F + S) clipped to [0, 1]     F = --sim-output-fraction, S = --sim-output-spread
    target   = clamp(round(fraction x max_new_tokens), 1, max_new_tokens)   and <= --sim-output-cap if set
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from proxy.sim.ratio import CLIP_MAX_NEW_TOKENS


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    """One request of a workload. Give ``prompt_ids`` (shared prefixes are cached) or ``prompt_len``
    (a prompt of unique tokens)."""

    arrival: float = 0.0  # seconds from the start of the run
    prompt_len: int = 0
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    output_len: int | None = None  # the true output length; None: drawn from the distribution
    rid: str | None = None
    # running on the engine a replay stands for when the replay began: its prompt (what it wrote so far
    # among it) is in that engine's KV already, so computing it costs the replay no time
    resumed: bool = False
    # (group, tokens): the prompt's first ``tokens`` are its group's, the same in every request of the
    # group (a shared system prompt the radix cache reuses); the rest its own. Only with ``prompt_len``
    shared: tuple[int, int] | None = None


def draw_target(rng: random.Random, max_new: int, fraction: float, spread: float, cap: int | None) -> int:
    f = fraction if spread <= 0 else fraction + spread * (2.0 * rng.random() - 1.0)
    f = min(1.0, max(0.0, f))
    target = max(1, round(f * max_new))
    if cap is not None:
        target = min(target, cap)
    return min(target, max_new)


class State(IntEnum):
    WAITING = 0
    PREFILLING = 1  # admitted in the step now running, or the chunked request between chunks
    RUNNING = 2
    FINISHED = 3


class Req:
    """The engine's state of one request. Output counts are kept lazily while it runs:
    ``out = out_base + (engine decode steps - step_base)``."""

    __slots__ = (
        "arrival",
        "big",
        "cached_tokens",
        "fill_ids",
        "finish_g",
        "finish_reason",
        "finish_time",
        "first_token_time",
        "handle",
        "ignore_eos",
        "max_new",
        "node",
        "num_retractions",
        "out_base",
        "prefilled",
        "priority",
        "private_base",
        "prompt_ids",
        "queued_seq",
        "resumed",
        "rid",
        "seq",
        "state",
        "step_base",
        "stream",
        "target",
        "token_seed",
    )  # fmt: skip

    def __init__(
        self,
        *,
        rid: str,
        seq: int,
        arrival: float,
        prompt_ids: tuple[int, ...],
        max_new: int,
        ignore_eos: bool,
        target: int,
        token_seed: int,
        stream: bool = False,
        priority: int = 0,
        resumed: bool = False,
    ) -> None:
        self.rid = rid
        self.resumed = resumed  # its KV was computed before the run began (RequestSpec.resumed)
        self.priority = priority  # SGLang's per-request priority (only ordered under priority scheduling)
        self.queued_seq = seq  # when it last entered the waiting queue (SGLang's wait_queue_entry_time)
        self.seq = seq
        self.arrival = arrival
        self.prompt_ids = prompt_ids
        self.max_new = max_new
        self.ignore_eos = ignore_eos
        self.target = max_new if ignore_eos else min(target, max_new)
        self.token_seed = token_seed
        self.stream = stream
        self.state = State.WAITING
        self.out_base = 0
        self.step_base = 0
        self.finish_g = 0
        self.fill_ids: tuple[int, ...] = prompt_ids  # what the next prefill computes (prompt + outputs so far)
        self.prefilled = 0  # tokens of fill_ids already in KV (cached prefix + computed chunks)
        self.node: Any = None  # the prefix-cache node this request holds locked
        self.private_base = 0  # KV tokens it owns outside the prefix cache, decode tokens aside
        self.num_retractions = 0
        self.cached_tokens = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: dict[str, Any] | None = None
        self.handle: Any = None  # the HTTP layer's per-request object
        self.big = max_new > CLIP_MAX_NEW_TOKENS  # its reservation is clipped: kept outside the running sums

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
