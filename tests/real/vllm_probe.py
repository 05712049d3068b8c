"""Runs inside the vLLM environment: vLLM's own OpenAI-server parser judges our argv.

``python vllm_probe.py < cases.json``: each case ``{"id", "argv", "fields"}`` is parsed by the
parser ``python -m vllm.entrypoints.openai.api_server`` builds; the answer lists, per case, the
parsed value of each named field or the parser's refusal message.
"""

from __future__ import annotations

import json
import sys


class Refused(Exception):
    pass


def main() -> int:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # 0.32
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser  # older layout
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise Refused(message)

    parser = make_arg_parser(Parser(prog="vllm serve"))
    out = []
    for case in json.load(sys.stdin):
        try:
            ns = parser.parse_args(case["argv"])
        except (Refused, SystemExit, ValueError) as exc:
            out.append({"id": case["id"], "refused": str(exc)})
            continue
        missing = object()
        parsed = {}
        for name in case["fields"]:
            value = getattr(ns, name, missing)
            parsed[name] = {"missing": True} if value is missing else {"value": value}
        out.append({"id": case["id"], "parsed": parsed})
    json.dump(out, sys.stdout, default=repr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
