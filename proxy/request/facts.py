"""Facts per request, as the relay saw them, kept per worker for the controller to read.

A :class:`RequestFact` is what one answered request showed: its prompt and output tokens (the
answer's ``usage``), the ``max_tokens`` it asked for, its finish reason, its time to first token
(from the dispatch to the first output the client got), its time in the proxy's queue and the
class it was sent as (``interactive``: latency-sensitive, judged on its first tokens; or batch). The
relay records one per answered attempt into the worker's :class:`WorkerFacts` (a bounded ring,
held by the worker's :class:`~proxy.request.pacing.WorkerLoad`); figures are computed when read
(once per scrape), never per chunk.

Where the usage comes from: a plain answer carries it in its body (parsed once, after it was
received); a stream carries it in its final event only when the request asked for
``stream_options.include_usage``, so the relay asks for it on every stream and strips the usage
event again when the client did not ask (:func:`wants_usage`, :func:`strip_usage`): that event has
no choices (OpenAI's shape) and is the last before ``data: [DONE]``.

Engine-neutral: this is the OpenAI response shape both engines answer in; no engine is read here.
``output_ratio`` (output tokens over ``max_tokens``) is what an engine's admission
conservativeness is about; the proxy sees it directly.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "RequestFact",
    "WorkerFacts",
    "read_usage",
    "strip_usage",
    "usage_of_stream",
]

_KEEP = 2048  # answers kept per worker: a plan replays up to twice the running batch (economics)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFact:
    time: float  # when it ended (monotonic)
    arrived: float  # when it reached the proxy's queue (monotonic)
    prompt_tokens: int | None
    output_tokens: int | None
    max_tokens: int | None  # as asked (None: not given)
    finish_reason: str | None
    ttft_s: float | None  # dispatch to first output
    queue_s: float  # time in the proxy's queue
    interactive: bool = True  # sent as the interactive class (False: batch)
    sent_max_tokens: int | None = None  # what the worker was asked for at first (the output budget; None: as asked)
    parts: int = 1  # the answer's parts: more than one when it reached its output budget and was continued
    # of ``output_tokens``, what an earlier attempt wrote before it was taken back: this worker went on from there
    written_before: int = 0
    prefix_key: int | None = None  # its prompt's leading text as a key (requests that share a head share it)
    cached_tokens: int | None = None  # prompt tokens the engine found cached (its usage; None: not said)

    @property
    def dispatched(self) -> float:
        """When the proxy sent it to the worker (monotonic)."""
        return self.arrived + self.queue_s

    @property
    def first_token(self) -> float | None:
        """When its first output reached the proxy (monotonic; None: a whole answer, not seen)."""
        return None if self.ttft_s is None else self.dispatched + self.ttft_s

    @property
    def output_ratio(self) -> float | None:
        if self.output_tokens is None or not self.max_tokens:
            return None
        return self.output_tokens / self.max_tokens


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class WorkerFacts:
    """The latest requests one worker answered (a bounded ring) and the figures over them."""

    __slots__ = ("_facts", "answered")

    def __init__(self, keep: int = _KEEP) -> None:
        self._facts: deque[RequestFact] = deque(maxlen=keep)
        self.answered = 0  # total recorded (monotonic)

    def record(self, fact: RequestFact) -> None:
        self._facts.append(fact)
        self.answered += 1

    def recent(self, since: float | None = None, interactive: bool | None = None) -> list[RequestFact]:
        """The facts of requests that ended at ``since`` or later, of one class (``interactive``) or both (None)."""
        return [
            f
            for f in self._facts
            if (since is None or f.time >= since) and (interactive is None or f.interactive is interactive)
        ]

    def written(
        self,
        *,
        interactive: bool,
        arrived_before: float = math.inf,
        arrived_from: Callable[[int], float] = lambda _asked: -math.inf,
    ) -> dict[int, list[int]]:
        """Output tokens of the class's answered requests that arrived before ``arrived_before`` (and
        at ``arrived_from(max_tokens)`` or later), oldest first, by the ``max_tokens`` they asked for
        (what the output budget reads; requests that gave none are left out)."""
        out: dict[int, list[int]] = {}
        for f in self._facts:
            if f.interactive is not interactive or f.output_tokens is None or f.max_tokens is None:
                continue
            if arrived_from(f.max_tokens) <= f.arrived < arrived_before:
                out.setdefault(f.max_tokens, []).append(f.output_tokens)
        return out

    def ended_within_budget(
        self, *, interactive: bool, max_tokens: int, sent_after: float, ended_since: float = -math.inf
    ) -> int:
        """The class's answers asking for ``max_tokens`` sent under an output budget after
        ``sent_after`` that ended in their first part (at ``ended_since`` or later): the budget held them."""
        return sum(
            1
            for f in self._facts
            if f.interactive is interactive
            and f.max_tokens == max_tokens
            and f.sent_max_tokens is not None
            and f.parts == 1
            and f.dispatched > sent_after
            and f.time >= ended_since
        )

    def __len__(self) -> int:
        return len(self._facts)

    def mean_output_tokens(self, since: float | None = None, interactive: bool | None = None) -> float | None:
        return _mean([float(f.output_tokens) for f in self.recent(since, interactive) if f.output_tokens is not None])

    def mean_prompt_tokens(self, since: float | None = None, interactive: bool | None = None) -> float | None:
        """As the engine counted them (the proxy's own estimate of an open request's is from its bytes)."""
        return _mean([float(f.prompt_tokens) for f in self.recent(since, interactive) if f.prompt_tokens is not None])

    def output_ratio(self, since: float | None = None) -> float | None:
        """Median of output tokens / ``max_tokens`` (None: no request said both)."""
        ratios = [r for f in self.recent(since) if (r := f.output_ratio) is not None]
        return statistics.median(ratios) if ratios else None

    def mean_ttft(
        self, since: float | None = None, interactive: bool | None = None, sent_after: float = -math.inf
    ) -> float | None:
        """The mean time to first token of the requests that ended at ``since`` or later, of one class or
        both, sent to the worker after ``sent_after`` (None: none)."""
        return _mean(
            [f.ttft_s for f in self.recent(since, interactive) if f.ttft_s is not None and f.dispatched > sent_after]
        )

    def summary(self) -> dict[str, float | int | None]:
        facts = self.recent()
        prompts = [float(f.prompt_tokens) for f in facts if f.prompt_tokens is not None]
        ratio = self.output_ratio()
        out = self.mean_output_tokens()
        ttft = self.mean_ttft()
        return {
            "answered": self.answered,
            "recent": len(facts),
            "mean_prompt_tokens": round(m, 1) if (m := _mean(prompts)) is not None else None,
            "mean_output_tokens": round(out, 1) if out is not None else None,
            "output_ratio": round(ratio, 4) if ratio is not None else None,
            "mean_ttft_s": round(ttft, 4) if ttft is not None else None,
            "length_finished": sum(1 for f in facts if f.finish_reason == "length"),
        }


def read_usage(body: bytes) -> tuple[int | None, int | None, str | None, int | None]:
    """(prompt tokens, output tokens, first finish reason, prompt tokens the engine found cached) of a
    whole JSON answer, in one parse (Nones: not said). Cached tokens are OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (SGLang with ``--enable-cache-report``, vLLM)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None, None, None
    return (*_usage_fields(payload), _cached_tokens(payload))


def _cached_tokens(payload: Any) -> int | None:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _usage_fields(payload: Any) -> tuple[int | None, int | None, str | None]:
    if not isinstance(payload, dict):
        return None, None, None
    usage = payload.get("usage")
    prompt = output = None
    if isinstance(usage, dict):
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        prompt = p if isinstance(p, int) else None
        output = c if isinstance(c, int) else None
    reason = None
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        r = choices[0].get("finish_reason")
        reason = r if isinstance(r, str) else None
    return prompt, output, reason


def usage_of_stream(tail: bytes) -> tuple[int | None, int | None, str | None, int | None]:
    """The usage, finish reason and cached prompt tokens (as :func:`read_usage`) in the last events of a
    stream (``tail``: its last chunks)."""
    prompt = output = cached = None
    reason = None
    for event in tail.split(b"\n\n"):
        line = event.strip()
        if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
            continue
        try:
            payload = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        p, o, r = _usage_fields(payload)
        prompt = p if p is not None else prompt
        output = o if o is not None else output
        reason = r if r is not None else reason
        c = _cached_tokens(payload)
        cached = c if c is not None else cached
    return prompt, output, reason, cached


def strip_usage(data: bytes) -> bytes:
    """``data`` (stream bytes) without its usage-only events (no choices, a usage object)."""
    if b'"usage"' not in data:
        return data
    kept = []
    for event in data.split(b"\n\n"):
        line = event.strip()
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                payload = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                payload = None
            if isinstance(payload, dict) and not payload.get("choices") and isinstance(payload.get("usage"), dict):
                continue
        kept.append(event)
    return b"\n\n".join(kept)
