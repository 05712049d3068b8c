"""The output budget: the worker sees a smaller ``max_tokens``, and an answer that reaches it goes on.

Why: SGLang reserves KV for what each request may still write, its whole ``max_tokens`` at first.
Clients ask for far more than they write, so the engine holds requests back for KV never used; a
lower ``--schedule-conservativeness`` takes a restart and applies to every request alike. The
proxy sees what answers of each class write, so it sends each request with ``max_tokens`` at the
worker's budget (:func:`proxy.control.fast_tier.output_budget`), with no restart. An answer that
reaches the budget is continued: the same request with the text so far (a chat's last message is
the assistant's text; a completion's prompt ends with it), on the same worker within the same
attempt, until it ends by itself or at the client's ``max_tokens``. The client gets one answer, or
one stream (:mod:`proxy.request.stitch`), with the usage of all parts.

Which requests (:func:`plan`): plain answers, where a continuation is the same generation (one
choice; no log probabilities, tools, structured output, stop strings, output penalties,
``min_tokens``, ``seed``, ``ignore_eos``, ``echo`` or ``suffix``), on an engine that reserves
``max_tokens`` and can continue on the route, where the budget saves a real share.

What cannot be continued (a split answer, a tool call, a refused part) is sent again whole within
the same attempt, as the client asked. A stream has sent its text already: a refused continuation
is asked once more, then goes on from the client's text on the next attempt, as a stream whose
worker died does (:mod:`proxy.request.parts`). The engine tokenizes the text again at the seam.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.request.job import Job

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MIN_SAVING",
    "Capped",
    "Part",
    "applies_above",
    "continuation_body",
    "merge",
    "plain",
    "plan",
    "read_part",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# fields whose effect a continuation would change (or that the proxy cannot carry across the seam),
# unless they hold the value that means "none": the request is sent as it came
_NEUTRAL: Mapping[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
    "structural_tag": (None,),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "seed": (None,),
    "ignore_eos": (None, False),
    "logit_bias": (None, {}),
    "continue_final_message": (None, False),
}


@dataclass(frozen=True, slots=True)
class Capped:
    """How one request is sent under the budget: its ``field`` (``max_tokens`` or
    ``max_completion_tokens``) at ``sent`` instead of the client's ``asked``."""

    field: str
    asked: int
    sent: int

    def body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The body with the budget's ``max_tokens`` (a copy: the job's own stays as asked)."""
        return {**body, self.field: self.sent}

    def next_cap(self, written: int, budget: int) -> int:
        """What the next part may write: what is left of the client's ``max_tokens``, and no more
        than the budget or what was written so far, whichever is larger (an answer far past the
        budget takes few parts: each at most doubles it)."""
        return max(1, min(self.asked - written, max(budget, written)))


def _neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (None and booleans by identity: ``True`` is not ``1``)."""
    return any(
        value is n if n is None or isinstance(n, bool) else value == n and not isinstance(value, bool) for n in neutral
    )


MIN_SAVING = 0.25  # a budget applies to a request only this far below its max_tokens (else: sent as it came)


def applies_above(budget: int, min_saving: float = MIN_SAVING) -> int:
    """The least ``max_tokens`` of a request that ``budget`` applies to (:func:`plan`)."""
    return math.ceil(budget / (1.0 - min_saving))


def plan(job: Job, budget: int | None, *, min_saving: float = MIN_SAVING) -> Capped | None:
    """The cap for ``job`` under ``budget`` output tokens (None: sent as it came). ``min_saving``:
    the budget must be at least this share below the client's ``max_tokens``."""
    if budget is None or budget <= 0:
        return None
    whole = plain(job)
    if whole is None or budget > whole.asked * (1.0 - min_saving):
        return None
    return Capped(field=whole.field, asked=whole.asked, sent=budget)


def plain(job: Job) -> Capped | None:
    """``job`` as it asks (``sent`` is its own ``max_tokens``) when its answer can be continued: a
    plain request (the module docstring), else None."""
    if job.path not in (CHAT, COMPLETIONS):
        return None
    body = job.body
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    asked = body.get(field)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked <= 0:
        return None
    for name, neutral in _NEUTRAL.items():
        if name in body and not _neutral(body[name], neutral):
            return None
    if job.path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return None
        if messages[-1].get("role") == "assistant":
            return None  # the client's own prefill: its continuation is the client's to ask for
    elif not isinstance(body.get("prompt"), str):
        return None  # a prompt of token ids or several prompts: one plain text only
    return Capped(field=field, asked=asked, sent=asked)


@dataclass(frozen=True, slots=True)
class Part:
    """One part's answer, as the relay needs it to go on or to merge."""

    payload: dict[str, Any]  # the whole answer, parsed
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


def read_part(path: str, body: bytes) -> Part | None:
    """The part in a whole answer on ``path``; None when it is not one plain choice with its usage
    (then it cannot be continued: the request goes again whole)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    choices, usage = payload.get("choices"), payload.get("usage")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    if not isinstance(usage, dict):
        return None
    prompt, written = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(written, int):
        return None
    choice = choices[0]
    if path == CHAT:
        message = choice.get("message")
        if not isinstance(message, dict) or message.get("tool_calls") or message.get("reasoning_content"):
            return None  # a split or structured answer: its text alone does not continue it
        text = message.get("content")
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        return None
    reason = choice.get("finish_reason")
    return Part(payload, text, prompt, written, reason if isinstance(reason, str) else None)


def continuation_body(
    path: str, body: Mapping[str, Any], written_text: str, cap: Capped, max_tokens: int, fields: Mapping[str, object]
) -> dict[str, Any]:
    """The request that continues ``body``'s answer after ``written_text``, for at most ``max_tokens``
    more; ``fields``: the engine's continuation fields (its contract's ``continuation_fields``)."""
    if path == CHAT:
        out = {**body, "messages": [*body["messages"], {"role": "assistant", "content": written_text}]}
    else:
        out = {**body, "prompt": body["prompt"] + written_text}
    out[cap.field] = max_tokens
    out.update(fields)
    return out


def merge(path: str, parts: list[Part]) -> bytes:
    """One answer from its parts: the first part's shape and prompt tokens, every part's text and
    completion tokens, the last part's finish reason."""
    first = parts[0]
    text = "".join(p.text for p in parts)
    written = sum(p.completion_tokens for p in parts)
    payload = dict(first.payload)
    choice = dict(payload["choices"][0])
    if path == CHAT:
        choice["message"] = {**choice["message"], "content": text}
    else:
        choice["text"] = text
    last = parts[-1].payload["choices"][0]
    choice["finish_reason"] = last.get("finish_reason")
    if "matched_stop" in last or "matched_stop" in choice:
        choice["matched_stop"] = last.get("matched_stop")
    payload["choices"] = [choice]
    usage = dict(payload["usage"])
    usage["completion_tokens"] = written
    usage["total_tokens"] = first.prompt_tokens + written
    payload["usage"] = usage
    return orjson.dumps(payload)
