"""vLLM 0.32's own parser judges every argv the vLLM engine module can build (each flag across the
values its table allows, each knob across its bounds, with ``--host``/``--port``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from proxy.engines.flags import FlagSpec
from proxy.engines.vllm.argv import KNOWN_FLAGS, build_argv, placement_args
from proxy.engines.vllm.knobs import KNOBS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROBE = Path(__file__).with_name("vllm_probe.py")
HOST, PORT = "127.0.0.1", 8001
ALWAYS = {"model": "tiny-llama", "host": HOST, "port": PORT}


def _values(spec: FlagSpec) -> list[object]:
    if spec.type == "bool":
        return [True, False]
    if spec.type == "int_list":
        return [[1], [1, 2, 4, 8, 16, 32]]
    if spec.type in ("int", "float"):
        low = spec.minimum if spec.minimum is not None else 0
        high = spec.maximum if spec.maximum is not None else low + 4096
        vals = (low, high, (low + high) / 2)
        return sorted({int(v) for v in vals} if spec.type == "int" else {float(v) for v in vals})
    if spec.choices:
        return list(spec.choices)
    return ["some-value"]


def cases() -> list[dict]:
    pairs = [(n, v) for n, spec in KNOWN_FLAGS.items() if n != "quantization" for v in _values(spec)]
    pairs += [("quantization", "fp8")]  # a free string in our table; vLLM checks the method name
    for knob in KNOBS.values():
        pairs += [(knob.arg, knob.clamp(v)) for v in sorted({knob.minimum, knob.maximum, *knob.ladder})]
    out = []
    for i, (name, value) in enumerate(pairs):
        expected = {**ALWAYS, name: value}
        argv = build_argv({"model": ALWAYS["model"], name: value}, [], host=HOST, port=PORT)
        out.append({"id": f"{i}:{name}={value}", "argv": argv, "fields": sorted(expected), "expected": expected})
    for tp in (1, 2, 4, 8):  # what a pool's placement adds (its GPUs are the worker's CUDA_VISIBLE_DEVICES)
        args = {"model": ALWAYS["model"], **placement_args(tp, "pool-model")}
        expected = {**ALWAYS, **args}
        argv = build_argv(args, [], host=HOST, port=PORT)
        out.append({"id": f"placement:tp={tp}", "argv": argv, "fields": sorted(expected), "expected": expected})
    return out


def _same(parsed: object, intended: object, name: str) -> bool:
    if isinstance(intended, float) or isinstance(parsed, float):
        return isinstance(parsed, (int, float)) and abs(float(parsed) - float(intended)) < 1e-9  # type: ignore[arg-type]
    if name in ("served_model_name", "api_key") and isinstance(parsed, list):
        return parsed == [intended]  # nargs="+" fields
    return parsed == intended


def test_every_argv_the_module_builds_parses_to_the_intended_values(vllm_python: Path) -> None:
    all_cases = cases()
    proc = subprocess.run(
        [str(vllm_python), str(PROBE)], input=json.dumps(all_cases), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = {a["id"]: a for a in json.loads(proc.stdout)}
    problems = []
    for case in all_cases:
        answer = answers[case["id"]]
        if "refused" in answer:
            problems.append(f"{case['id']}: vLLM refused {case['argv']}: {answer['refused']}")
            continue
        for name, intended in case["expected"].items():
            got = answer["parsed"][name]
            if got.get("missing"):
                problems.append(f"{case['id']}: vLLM has no field {name!r}")
            elif not _same(got["value"], intended, name):
                problems.append(f"{case['id']}: {name} parsed as {got['value']!r}, intended {intended!r}")
    assert not problems, "\n".join(problems)
