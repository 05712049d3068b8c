"""SGLang 0.5.23 itself judges what the proxy would launch, and what it reads back.

SGLang cannot serve without a GPU, but its argument parser runs on the CPU: every argv the SGLang
engine module can build (each flag of its table across the values the table allows, each knob
across its ladder and the policy's bounds, with the flags the supervisor always adds) is parsed by
``ServerArgs.add_cli_args`` in a cached environment holding the real package, and the parsed
values must be the intended ones. A renamed or split flag fails here, not on a GPU host.

The metrics side: SGLang's collector classes cannot be instantiated outside a server (their module
imports the model configs), so the gauges and counters they declare are read from the installed
source and exposed by prometheus_client as declared; the proxy's SGLang scraper must read that
page (see sglang_probe.py).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from proxy.control.rules import RuleSettings
from proxy.engines.sglang.argv import KNOWN_FLAGS, FlagSpec, build_argv, placement_args
from proxy.engines.sglang.knobs import KNOBS
from proxy.engines.sglang.metrics import FIELDS, PREFIX, parse_metrics
from proxy.policy import ControlSettings, EngineKind, load_policy
from proxy.workers.fleet import placement_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROBE = Path(__file__).with_name("sglang_probe.py")
POLICIES = Path(__file__).parents[2] / "policies"
HOST, PORT = "127.0.0.1", 30001
ALWAYS = {"model_path": "tiny-llama", "host": HOST, "port": PORT, "enable_metrics": True}


def _values(name: str, spec: FlagSpec) -> list[object]:
    """Values the table allows for one flag: its bounds and a middle value, or every choice."""
    if spec.type == "bool":
        return [True]
    if spec.type == "int_list":
        return [[1], [1, 2, 4, 8, 16, 32]]
    if spec.type in ("int", "float"):
        low = spec.minimum if spec.minimum is not None else 0
        high = spec.maximum if spec.maximum is not None else max(low, 0) + 4096
        vals = [low, high, (low + high) / 2]
        return sorted({int(v) for v in vals} if spec.type == "int" else {float(v) for v in vals})
    if spec.choices:
        return list(spec.choices)
    return {"log_level": ["debug", "info", "warning"], "log_level_http": ["warning"]}.get(name, ["some-value"])


def _knob_values() -> list[tuple[str, object]]:
    rules = RuleSettings(control=ControlSettings(), knobs=KNOBS)
    out: list[tuple[str, object]] = []
    for knob in KNOBS.values():
        if knob.choices:  # a knob that takes names: each of them
            out += [(knob.arg, choice) for choice in knob.choices]
            continue
        vals = {knob.minimum, knob.maximum, *knob.ladder}
        if knob.disabled is not None:
            vals.add(knob.disabled)
        if knob.default is not None:
            vals.add(knob.default)
        vals |= {v for v in rules.bounds(knob.name) if math.isfinite(v)}  # the range the controller moves it in
        out += [(knob.arg, knob.clamp(v) if v != knob.disabled else v) for v in sorted(vals)]
    return out


def cases() -> list[dict]:
    pairs = [(name, v) for name, spec in KNOWN_FLAGS.items() for v in _values(name, spec)] + _knob_values()
    out = []
    for i, (name, value) in enumerate(pairs):
        args = {"model_path": ALWAYS["model_path"], name: value}
        expected = {**ALWAYS, name: value}
        out.append({
            "id": f"{i}:{name}={value}",
            "argv": build_argv(args, [], host=HOST, port=PORT),
            "fields": sorted(expected),
            "expected": expected,
        })  # fmt: skip
    for tp in (1, 2, 4, 8):  # what a pool's placement adds (its GPUs are the worker's CUDA_VISIBLE_DEVICES)
        args = {"model_path": ALWAYS["model_path"], **placement_args(tp, "pool-model")}
        expected = {**ALWAYS, **args}
        out.append({
            "id": f"placement:tp={tp}",
            "argv": build_argv(args, [], host=HOST, port=PORT),
            "fields": sorted(expected),
            "expected": expected,
        })  # fmt: skip
    for path in sorted(POLICIES.glob("*.toml")):  # the shipped policies for real SGLang workers, each pool
        for pool in load_policy(path).pools:
            engine = pool.engine
            if engine.kind is not EngineKind.SGLANG:
                continue
            args = {**engine.args, **(placement_of(pool, ()).args)}
            expected = {**args, "host": HOST, "port": PORT, "enable_metrics": True}
            out.append({
                "id": f"policy:{path.name}:{pool.name}",
                "argv": build_argv(args, engine.extra_args, host=HOST, port=PORT),
                "fields": sorted(expected),
                "expected": expected,
            })  # fmt: skip
    return out


def _probe(python: Path, command: str, payload: object) -> str:
    proc = subprocess.run(
        [str(python), str(PROBE), command], input=json.dumps(payload), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _same(parsed: object, intended: object) -> bool:
    if isinstance(intended, float) or isinstance(parsed, float):
        return isinstance(parsed, (int, float)) and abs(float(parsed) - float(intended)) < 1e-9  # type: ignore[arg-type]
    return parsed == intended


def test_every_argv_the_module_builds_parses_to_the_intended_values(sglang_python: Path) -> None:
    all_cases = cases()
    assert len(all_cases) > 100
    assert any(c["id"].startswith("policy:") for c in all_cases)
    answers = {a["id"]: a for a in json.loads(_probe(sglang_python, "parse", all_cases))}
    problems = []
    for case in all_cases:
        answer = answers[case["id"]]
        if "refused" in answer:
            problems.append(f"{case['id']}: SGLang refused {case['argv']}: {answer['refused']}")
            continue
        for name, intended in case["expected"].items():
            got = answer["parsed"][name]
            if got.get("missing"):
                problems.append(f"{case['id']}: SGLang has no field {name!r}")
            elif not _same(got["value"], intended):
                problems.append(f"{case['id']}: {name} parsed as {got['value']!r}, intended {intended!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-graph-max-bs", "8"], "ambiguous option: --cuda-graph-max-bs"),  # split into _decode/_prefill in 0.5.x
        (["--max-running-request", "8", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_sglang_refuses_what_it_no_longer_knows(sglang_python: Path, argv: list[str], message: str) -> None:
    case = {"id": "x", "argv": ["--model-path", "m", *argv], "fields": []}
    (answer,) = json.loads(_probe(sglang_python, "parse", [case]))
    assert message in answer.get("refused", ""), answer


def test_scraper_reads_the_metrics_sglang_declares(sglang_python: Path) -> None:
    declared = json.loads(_probe(sglang_python, "declared", None))
    names = {m["name"] for m in declared}
    assert len(names) > 30
    # the newest name of every field the scraper reads is one SGLang 0.5.23 declares
    newest = {field: PREFIX + names_[0] for field, (names_, _) in FIELDS.items()}
    assert {f: n for f, n in newest.items() if n not in names} == {}
    values = {
        "sglang:num_running_reqs": 7, "sglang:num_queue_reqs": 42, "sglang:token_usage": 0.83,
        "sglang:gen_throughput": 1234.5, "sglang:cache_hit_rate": 0.25, "sglang:new_token_ratio": 0.4,
        "sglang:max_total_num_tokens": 500000, "sglang:num_retracted_requests_total": 3,
        "sglang:prompt_tokens_total": 1000, "sglang:generation_tokens_total": 2000, "sglang:num_requests_total": 9,
    }  # fmt: skip
    page = _probe(sglang_python, "metrics", values)
    sample = parse_metrics(page, 3.0)
    assert (sample.running, sample.queue, sample.token_usage) == (7, 42, 0.83)
    assert (sample.gen_throughput, sample.cache_hit_rate, sample.new_token_ratio) == (1234.5, 0.25, 0.4)
    assert sample.max_total_tokens == 500000
    assert (sample.retractions_total, sample.prompt_tokens_total, sample.generation_tokens_total) == (3, 1000, 2000)
    assert sample.requests_total == 9
