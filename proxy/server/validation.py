"""Check a request body once and describe what to forward (pure functions, no I/O).

The body is parsed with orjson exactly once; the resulting dict is what the relay re-encodes for
the worker (adding the name it aborts a request by, on an engine that has one). Checks are the ones a worker would
otherwise answer with a 4xx after the request had waited in the queue, or answer with a 500.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import bad_request
from proxy.request.job import Job

# route -> the worker path it forwards to
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
AFFINITY_CHARS = 256  # prefix length used for prefix-aware worker choice


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _non_negative_int(body: dict[str, Any], name: str, label: str | None = None) -> None:
    v = body.get(name)
    if v is None:
        return
    label = label or name
    if not _is_int(v):
        raise bad_request(f"'{label}' must be an integer, got {type(v).__name__}", label)
    if v < 0:
        raise bad_request(f"'{label}' must be >= 0, got {v}", label)


def _stream_flag(body: dict[str, Any]) -> bool:
    v = body.get("stream", False)
    if v is None:
        v = False
    if not isinstance(v, bool):
        raise bad_request(f"'stream' must be a boolean, got {type(v).__name__}", "stream")
    options = body.get("stream_options")
    if options is not None:  # the proxy adds include_usage to it: a wrong one is refused, not replaced
        if not isinstance(options, dict):
            raise bad_request(f"'stream_options' must be an object, got {type(options).__name__}", "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad_request(
                f"'stream_options.include_usage' must be a boolean, got {type(usage).__name__}",
                "stream_options.include_usage",
            )
    return v


def _model(body: dict[str, Any]) -> str | None:
    v = body.get("model")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise bad_request("'model' must be a non-empty string", "model")
    return v


def _common_sampling(body: dict[str, Any]) -> None:
    _non_negative_int(body, "max_tokens")
    _non_negative_int(body, "max_completion_tokens")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise bad_request(f"'n' must be an integer >= 1, got {n!r}", "n")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", name)


def _cost(raw: bytes, limits: dict[str, Any], sampling: dict[str, Any]) -> tuple[int, int | None, int]:
    """(body bytes, max tokens asked for, n): what fair admission estimates a request's tokens from."""
    asked = next(
        (v for k in ("max_completion_tokens", "max_tokens", "max_new_tokens") if _is_int(v := limits.get(k))), None
    )
    n = sampling.get("n")
    return len(raw), asked, n if isinstance(n, int) and _is_int(n) and n >= 1 else 1


def validate_chat(raw: bytes) -> Job:
    body = parse_json_object(raw)
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'messages[{i}].role' is required and must be a string", f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"'messages[{i}].content' must be a string or an array", f"messages[{i}].content")
    _common_sampling(body)
    first = messages[0].get("content")
    affinity = first[:AFFINITY_CHARS] if isinstance(first, str) else None
    single = (body.get("n") or 1) == 1
    return Job(CHAT, body, _stream_flag(body), _model(body), affinity, single, *_cost(raw, body, body))


def validate_completions(raw: bytes) -> Job:
    body = parse_json_object(raw)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    affinity: str | None
    if isinstance(prompt, str):
        affinity, single = prompt[:AFFINITY_CHARS], True
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt):
            single = _is_int(prompt[0]) or len(prompt) == 1
        elif all(isinstance(p, list) and p and all(_is_int(x) for x in p) for p in prompt):
            single = len(prompt) == 1
        else:
            raise bad_request("'prompt' must be a string, an array of strings, or token ids", "prompt")
        affinity = prompt[0][:AFFINITY_CHARS] if isinstance(prompt[0], str) else None
    else:
        raise bad_request("'prompt' must be a non-empty string or array", "prompt")
    _common_sampling(body)
    single = single and (body.get("n") or 1) == 1
    return Job(COMPLETIONS, body, _stream_flag(body), _model(body), affinity, single, *_cost(raw, body, body))


def _max_new_tokens(sampling: dict[str, Any]) -> int:
    value = sampling.get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def validate_generate(raw: bytes) -> Job:
    """SGLang's native ``/generate``: ``text`` or ``input_ids``, optional ``sampling_params``; an
    optional ``model`` (not SGLang's: the proxy's, to pick the pool when it serves several) is taken
    out of the body before it is forwarded."""
    body = parse_json_object(raw)
    model = body.pop("model", None)
    if model is not None and not (isinstance(model, str) and model):
        raise bad_request("'model' must be a non-empty string", "model")
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None and body.get("input_embeds") is None:
        raise bad_request("one of 'text' or 'input_ids' is required", "text")
    if text is not None and not (
        isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))
    ):
        raise bad_request("'text' must be a string or a non-empty array of strings", "text")
    if ids is not None and not isinstance(ids, list):
        raise bad_request("'input_ids' must be an array", "input_ids")
    sp = body.get("sampling_params")
    each: list[dict[str, Any]]  # a batch of prompts may give each its own (GenerateReqInput takes a list)
    if sp is None:
        each = [{}]
    elif isinstance(sp, dict):
        each = [sp]
        _non_negative_int(sp, "max_new_tokens", "sampling_params.max_new_tokens")
    elif isinstance(sp, list) and sp and all(isinstance(one, dict) for one in sp):
        each = sp
        for i, one in enumerate(sp):
            _non_negative_int(one, "max_new_tokens", f"sampling_params[{i}].max_new_tokens")
    else:
        raise bad_request(
            "'sampling_params' must be an object, or an array of objects (one per prompt)", "sampling_params"
        )
    # the most any one prompt asks for; n > 1 makes SGLang run the prompt as a batch (its rid a list)
    unbounded = [one for one in each if _max_new_tokens(one) < 0]  # the engine's default, the estimate's too
    asked = unbounded[0] if unbounded else max(each, key=_max_new_tokens)
    cost = _cost(raw, asked, asked)
    one_prompt = isinstance(text, str) or (text is None and isinstance(ids, list) and (not ids or _is_int(ids[0])))
    single = one_prompt and isinstance(sp, dict | None) and cost[2] == 1
    affinity = text[:AFFINITY_CHARS] if isinstance(text, str) else None
    return Job(GENERATE, body, _stream_flag(body), model, affinity, single, *cost)


VALIDATORS = {CHAT: validate_chat, COMPLETIONS: validate_completions, GENERATE: validate_generate}
