"""Runs inside the SGLang environment (not this package's): SGLang's own code judges our output.

``python sglang_probe.py parse < cases.json``: each case ``{"id", "argv", "fields"}`` is parsed by
a parser built exactly as ``sglang serve`` builds it (``ServerArgs.add_cli_args``); the answer
lists, per case, the parsed value of each named field, or the parser's refusal message.

``python sglang_probe.py metrics < values.json``: SGLang's metrics collectors cannot be instantiated
outside a server (their module imports the model configs: transformers, torchvision, tvm_ffi), so
the gauges and counters they declare are read from the installed source with ``ast`` and
registered as declared (name, type, documentation, label names) in a fresh registry; the answer
is prometheus_client's exposition of them, with the given values.

``python sglang_probe.py declared``: the declared metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys


class Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refused(message)


def parse(cases: list[dict]) -> list[dict]:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    out = []
    for case in cases:
        try:
            ns = parser.parse_args(case["argv"])
        except Refused as exc:
            out.append({"id": case["id"], "refused": str(exc)})
            continue
        missing = object()
        parsed = {}
        for name in case["fields"]:
            value = getattr(ns, name, missing)
            parsed[name] = {"missing": True} if value is missing else {"value": value}
        out.append({"id": case["id"], "parsed": parsed})
    return out


COLLECTORS = ("SchedulerMetricsCollector", "TokenizerMetricsCollector")
LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


def declared_metrics() -> list[dict]:
    """Every Gauge and Counter SGLang's metric collectors declare: name, type, documentation, labels.

    Read from the installed ``metrics_collector.py`` with ``ast``: importing it needs a server's
    dependencies (transformers, torchvision, tvm_ffi through ``sglang.srt.configs``).
    """
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "srt" / "observability" / "metrics_collector.py"
    tree = ast.parse(source.read_text())
    found = []
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name in COLLECTORS):
            continue
        for node in ast.walk(cls):
            if not (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Gauge", "Counter")
            ):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if not isinstance(kw.get("name"), ast.Constant):
                continue
            doc = kw.get("documentation")
            try:
                labelnames = list(eval(compile(ast.Expression(kw["labelnames"]), str(source), "eval"),
                                       {"__builtins__": {}, "list": list, "labels": LABELS}))  # fmt: skip
            except Exception:
                continue  # label names computed from state we do not have
            found.append({
                "collector": cls.name,
                "type": node.func.id.lower(),
                "name": kw["name"].value,
                "documentation": doc.value if isinstance(doc, ast.Constant) else "",
                "labelnames": labelnames,
            })  # fmt: skip
    return found


def metrics(values: dict) -> str:
    """The exposition of SGLang's declared gauges and counters, each set to ``values[name]`` (else 0)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    for m in declared_metrics():
        cls = Gauge if m["type"] == "gauge" else Counter
        metric = cls(m["name"], m["documentation"] or m["name"], labelnames=m["labelnames"], registry=registry)
        labels = {k: LABELS.get(k, "x") for k in m["labelnames"]}
        child = metric.labels(**labels) if labels else metric
        value = float(values.get(m["name"], 0.0))
        child.set(value) if cls is Gauge else child.inc(value)
    return generate_latest(registry).decode()


def main(argv: list[str]) -> int:
    if argv[:1] == ["parse"]:
        json.dump(parse(json.load(sys.stdin)), sys.stdout, default=repr)
        return 0
    if argv[:1] == ["declared"]:
        json.dump(declared_metrics(), sys.stdout)
        return 0
    if argv[:1] == ["metrics"]:
        sys.stdout.write(metrics(json.load(sys.stdin)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
