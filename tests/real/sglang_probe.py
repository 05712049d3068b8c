"""Runs inside the SGLang environment (not this package's): SGLang's own code judges our output.

``python sglang_probe.py parse < cases.json``: each case ``{"id", "argv", "fields"}`` is parsed by
a parser built exactly as ``sglang serve`` builds it (``ServerArgs.add_cli_args``); the answer
lists, per case, the parsed value of each named field, or the parser's refusal message.

``python sglang_probe.py metrics``: instantiates SGLang's scheduler metrics collector outside a
server, feeds it one set of scheduler stats and prints the Prometheus exposition it produces.
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


def metrics(stats: dict) -> str:
    from prometheus_client import REGISTRY, generate_latest

    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector, SchedulerStats

    collector = SchedulerMetricsCollector(labels={"model_name": "tiny", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0})
    known = {k: v for k, v in stats.items() if hasattr(SchedulerStats(), k)}
    collector.log_stats(SchedulerStats(**known))
    return generate_latest(REGISTRY).decode()


def main(argv: list[str]) -> int:
    if argv[:1] == ["parse"]:
        json.dump(parse(json.load(sys.stdin)), sys.stdout, default=repr)
        return 0
    if argv[:1] == ["metrics"]:
        sys.stdout.write(metrics(json.load(sys.stdin)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
