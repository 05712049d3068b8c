"""Request bodies -> what the engine needs; SGLang's validation messages. Pure functions.

Every parser accepts and ignores fields it does not model (sampling knobs, ``model``, ``stop``...),
as SGLang does. The simulator-only ``sim_output_len`` (top level) fixes the true output length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.sim.config import SimConfig
from proxy.sim.tokenizer import chat_prompt, encode


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True, slots=True)
class GenParams:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = False
    output_len: int | None = None
    stream: bool = False
    rid: str | None = None
    include_usage: bool = False
    priority: int | None = None  # SGLang's request field; None: the server's default (the least important)
    # its answer goes on from the text at the end of its prompt (a chat's continue_final_message, a completion's
    # prompt that ends in a word): the first word starts with a space
    continues: bool = False


def _int(body: dict[str, Any], key: str, minimum: int = 0) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise BadRequest(f"{key} must be >= {minimum}, got {value}")
    return value


def _priority(body: dict[str, Any]) -> int | None:
    """SGLang's ``priority`` field (any integer; ignored by a server without priority scheduling)."""
    value = body.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"priority must be an integer, got {value!r}")
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be a boolean, got {value!r}")
    return value


def check_lengths(prompt_len: int, max_new: int | None, cfg: SimConfig) -> int:
    """The effective max_new_tokens, or SGLang's error for a request that cannot fit."""
    if prompt_len == 0:
        raise BadRequest("The input is empty: give a non-empty prompt.")
    if prompt_len > cfg.max_req_input_len:
        raise BadRequest(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({cfg.context_len} tokens)."
        )
    if max_new is None:
        return cfg.context_len - prompt_len
    if prompt_len + max_new > cfg.context_len:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {cfg.context_len} tokens. "
            f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages "
            f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
            f"or the completion to fit within the limit."
        )
    return max_new


def _prompt_ids(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, str):
        return encode(value)
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return tuple(value)
    raise BadRequest(f"{what} must be a string or a list of token ids")


def parse_generate(body: Any, cfg: SimConfig) -> tuple[list[GenParams], bool]:
    """Native ``/generate``: ``text`` or ``input_ids``, one or a batch (then the answer is a list)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    sp = body.get("sampling_params") or {}
    if not (isinstance(sp, dict) or (isinstance(sp, list) and all(isinstance(one, dict) for one in sp))):
        raise BadRequest("sampling_params must be an object or a list of objects (one per prompt)")
    out_len = _int(body, "sim_output_len", 1)
    stream = _bool(body, "stream")
    rid = body.get("rid")
    priority = _priority(body)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None:
        prompts = [text] if isinstance(text, str) else text
        if not isinstance(prompts, list) or not prompts or not all(isinstance(t, str) for t in prompts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        id_lists = [encode(t) for t in prompts]
        batch = not isinstance(text, str)
    else:
        batch = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
        given: list[Any] = ids if batch and isinstance(ids, list) else [ids]
        id_lists = [_prompt_ids(x, "input_ids") for x in given]
    if stream and len(id_lists) > 1:
        raise BadRequest("streaming a batch of prompts is not supported by the simulated engine")
    rids = rid if isinstance(rid, list) else [rid] * len(id_lists)
    each = sp if isinstance(sp, list) else [sp] * len(id_lists)  # GenerateReqInput: a dict, or one per prompt
    if len(each) != len(id_lists):
        raise BadRequest(f"sampling_params has {len(each)} entries for {len(id_lists)} prompts")
    params = []
    for p, r, one in zip(id_lists, rids, each, strict=False):
        max_new = _int(one, "max_new_tokens")
        params.append(
            GenParams(
                prompt_ids=p,
                max_new_tokens=check_lengths(len(p), 128 if max_new is None else max_new, cfg),
                ignore_eos=_bool(one, "ignore_eos"),
                output_len=out_len,
                stream=stream,
                rid=r if isinstance(r, str) else None,
                priority=priority,
            )
        )
    return params, batch


def _openai_common(body: dict[str, Any]) -> tuple[int | None, bool, int | None, bool, bool]:
    max_new = _int(body, "max_completion_tokens")
    if max_new is None:
        max_new = _int(body, "max_tokens")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise BadRequest("n > 1 is not supported by the simulated engine")
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    return max_new, _bool(body, "ignore_eos"), _int(body, "sim_output_len", 1), _bool(body, "stream"), include_usage


def parse_chat(body: Any, cfg: SimConfig) -> GenParams:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        turns.append((m["role"], content))
    max_new, ignore_eos, out_len, stream, usage = _openai_common(body)
    # continue_final_message: the last assistant message leaves the template and its text is appended
    # to the prompt, open (SGLang's serving_chat); otherwise a final assistant message is a turn
    continues = _bool(body, "continue_final_message") and turns[-1][0] == "assistant"
    ids = encode(chat_prompt(turns[:-1]) + turns[-1][1]) if continues else encode(chat_prompt(turns))
    rid = body.get("rid")  # SGLang's OpenAI requests accept a rid too (used by /abort_request)
    return GenParams(
        prompt_ids=ids,
        max_new_tokens=check_lengths(len(ids), max_new, cfg),
        ignore_eos=ignore_eos,
        output_len=out_len,
        stream=stream,
        include_usage=usage,
        rid=rid if isinstance(rid, str) else None,
        priority=_priority(body),
        continues=continues,
    )


def parse_completion(body: Any, cfg: SimConfig) -> list[GenParams]:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [_prompt_ids(p, "prompt") for p in prompt]
    else:
        prompts = [_prompt_ids(prompt, "prompt")]
    max_new, ignore_eos, out_len, stream, usage = _openai_common(body)
    max_new = 16 if max_new is None else max_new  # OpenAI's completions default
    if stream and len(prompts) > 1:
        raise BadRequest("streaming several prompts is not supported by the simulated engine")
    rid = body.get("rid")  # SGLang's OpenAI requests accept a rid too (used by /abort_request)
    rid = rid if isinstance(rid, str) and len(prompts) == 1 else None
    priority = _priority(body)
    # a text prompt that ends inside a line of words is continued by the next word, space first
    continues = isinstance(prompt, str) and prompt[-1:].isalnum()
    return [
        GenParams(
            prompt_ids=p,
            max_new_tokens=check_lengths(len(p), max_new, cfg),
            ignore_eos=ignore_eos,
            output_len=out_len,
            stream=stream,
            include_usage=usage,
            rid=rid,
            priority=priority,
            continues=continues,
        )
        for p in prompts
    ]
