"""SGLang 0.5.23's chat serving continues an answer where it stopped: the prompt is the request's own and the text.

The output budget continues a chat answer with the text so far as the last assistant message and
``continue_final_message`` (:mod:`proxy.request.continuation`). SGLang does not render that message
through the template: it takes it out, renders the rest with the generation prompt and appends the
text's tokens (``OpenAIServingChat._apply_jinja_template``). With a Llama-3-style template, whose
messages are trimmed and closed by ``<|eot_id|>``, the continuation's prompt must be the
request's own prompt followed by the text written, to the token, with no turn closed and no
whitespace lost. SGLang's methods run from its installed source (sglang_continue_probe.py says
why not by import), with the vLLM environment's transformers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROBE = Path(__file__).with_name("sglang_continue_probe.py")
USER = {"role": "user", "content": "write about the sea"}
CASES = [
    {"id": "words", "messages": [USER], "written": "the sea is wide and"},
    {"id": "a leading space", "messages": [USER], "written": " the sea"},
    {"id": "a leading newline", "messages": [USER], "written": "\nthe sea"},
    {"id": "a trailing space", "messages": [USER], "written": "the sea is "},
    {"id": "a trailing newline", "messages": [USER], "written": "the sea is\n\n"},
    {"id": "a cut word", "messages": [USER], "written": "the sea is wi"},
    {"id": "multi-turn", "written": "again the", "messages": [
        {"role": "system", "content": "be brief"}, USER, {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "more"}]},
]  # fmt: skip


def serving_chat_py(sglang_python: Path) -> Path:
    out = subprocess.run(
        [str(sglang_python), "-c", "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip()) / "srt" / "entrypoints" / "openai" / "serving_chat.py"


def test_the_continued_prompt_is_the_prompt_and_the_text(vllm_python: Path, sglang_python: Path) -> None:
    proc = subprocess.run(
        [str(vllm_python), str(PROBE), str(serving_chat_py(sglang_python))],
        input=json.dumps(CASES), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    caller, *answers = json.loads(proc.stdout)
    # the steps the probe follows are _apply_jinja_template's own: out with the assistant's message,
    # the template with the generation prompt, in with the text's tokens
    source = caller["source"]
    assert "self._handle_last_assistant_message(" in source
    assert "add_generation_prompt=add_generation_prompt is not False" in source
    assert "self._append_assistant_prefix_to_prompt_ids(" in source
    assert len(answers) == len(CASES)
    lost_by_transformers = []
    for case, got in zip(CASES, answers, strict=True):
        assert got["original_text"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n"), got
        assert got["continued_ids"] == got["original_ids"] + got["written_ids"], case["id"]
        assert got["continued_text"] == got["original_text"] + case["written"], case["id"]
        assert got["continued_text"].count("<|eot_id|>") == got["original_text"].count("<|eot_id|>"), case["id"]
        if got["transformers_continued_text"] != got["original_text"] + case["written"]:
            lost_by_transformers.append(case["id"])
    # transformers' own continue_final_message (vLLM's route) renders the text through the template:
    # Llama-3's trim drops its leading whitespace, and transformers then strips its trailing whitespace
    # (its end marker lost its space to the trim). SGLang's route keeps both.
    assert lost_by_transformers == ["a leading space", "a leading newline", "a trailing space", "a trailing newline"]
