"""Runs outside this package: SGLang's chat serving builds the prompt of a ``continue_final_message`` request.

``python sglang_continue_probe.py SERVING_CHAT_PY < cases.json``, with the vLLM environment's
interpreter (it has ``transformers``). SGLang's chat serving cannot be imported without a GPU
server's dependencies (torchvision and more, through its model configs), so the two methods that
make a continuation, ``_handle_last_assistant_message`` and ``_append_assistant_prefix_to_prompt_ids``,
are compiled from SGLang's installed ``serving_chat.py`` and run as ``_apply_jinja_template`` runs
them; its source is answered too, for the test to check those steps are still its steps.

The tokenizer is made here (no hub is reachable): byte-level BPE trained on generated text, with
Llama-3's special tokens and chat template (each message's content trimmed and closed by
``<|eot_id|>``), adding its BOS on encoding as Llama-3's does.

Each case ``{"id", "messages", "written"}``: the request's own prompt and its continuation's (an
assistant message holding ``written`` after ``messages``, with ``continue_final_message``, as the
proxy sends it): both prompts' ids and text, ``written``'s ids as encoded on its own, and for
contrast the text transformers' own ``continue_final_message`` renders (what vLLM does).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_tokenizer() -> Any:
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(2, 8))) for _ in range(600)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos = SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_TEMPLATE
    return fast


CONTINUATION_METHODS = ("_handle_last_assistant_message", "_append_assistant_prefix_to_prompt_ids")


def sglang_methods(source_path: Path) -> tuple[dict[str, Any], str]:
    """SGLang's own continuation methods of ``OpenAIServingChat``, compiled from its installed source,
    and the source of ``_apply_jinja_template`` (the caller, whose steps :func:`build` follows)."""
    source = source_path.read_text()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OpenAIServingChat"]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    module = ast.Module(body=[methods[name] for name in CONTINUATION_METHODS], type_ignores=[])
    namespace: dict[str, Any] = {"Any": Any, "List": list, "Dict": dict, "Optional": Optional, "Tuple": tuple,
                                 "ChatCompletionRequest": object,
                                 # no reasoning parser is configured: no detector is ever one
                                 "ResponseTemplateReasoningDetector": type("NoDetector", (), {})}  # fmt: skip
    exec(compile(module, str(source_path), "exec"), namespace)
    caller = ast.get_source_segment(source, methods["_apply_jinja_template"]) or ""
    return {name: namespace[name] for name in CONTINUATION_METHODS}, caller


def build(
    methods: dict[str, Any], tokenizer: Any, messages: list[dict[str, str]], *, continue_final: bool
) -> list[int]:
    """The prompt ids ``_apply_jinja_template`` builds for a plain text chat (no tools, no reasoning
    parser, the model's Jinja template): the last assistant message taken out by SGLang's method, the
    rest rendered with the generation prompt and encoded without special tokens (the template writes
    the BOS), then the assistant's text appended by SGLang's method."""
    chat = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer), _reasoning_detector=None)
    request = SimpleNamespace(continue_final_message=continue_final)
    messages, prefix = methods["_handle_last_assistant_message"](chat, [dict(m) for m in messages], request)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    if prefix:
        prompt_ids = methods["_append_assistant_prefix_to_prompt_ids"](chat, prompt_ids, prefix)
    return list(prompt_ids)


def main(argv: list[str]) -> int:
    (serving_chat,) = argv
    methods, caller = sglang_methods(Path(serving_chat))
    tokenizer = llama3_tokenizer()
    out: list[dict[str, Any]] = [{"id": "caller", "source": caller}]
    for case in json.load(sys.stdin):
        messages = case["messages"]
        original = build(methods, tokenizer, messages, continue_final=False)
        continued = build(methods, tokenizer, [*messages, {"role": "assistant", "content": case["written"]}],
                          continue_final=True)  # fmt: skip
        out.append({
            "id": case["id"],
            "original_ids": original,
            "continued_ids": continued,
            "original_text": tokenizer.decode(original),
            "continued_text": tokenizer.decode(continued),
            "written_ids": tokenizer.encode(case["written"], add_special_tokens=False),
            # the same request as transformers' own continue_final_message renders it (vLLM's way)
            "transformers_continued_text": tokenizer.apply_chat_template(
                [*messages, {"role": "assistant", "content": case["written"]}], tokenize=False,
                add_generation_prompt=False, continue_final_message=True),
        })  # fmt: skip
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
