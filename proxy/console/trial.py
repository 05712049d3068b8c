"""``pacer try``: ask a running proxy's controller to try arguments on one worker as a canary.

    pacer try --worker w1 --args max_running_requests=4 [--args k=v ...] [--note "why"]

The proxy (``POST /admin/trial``) restarts that worker with the arguments merged over its own,
journals it like a planner's decision (rule ``operator_trial``, reason "operator trial"), and
after its window the canary judges it against the other workers: promoted to all of them, kept on
that worker, or reverted. ``pacer decisions --rule operator_trial`` follows it. Values are read as
JSON where they parse (``4``, ``0.85``, ``true``), else as strings.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from proxy.console.admin import AdminClient, AdminError, add_connection_args


def parse_assignment(text: str) -> tuple[str, object]:
    """``name=value``: the value as JSON when it parses, else the text itself."""
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    try:
        parsed: object = orjson.loads(value)
    except orjson.JSONDecodeError:
        parsed = value
    if isinstance(parsed, (dict, list)):
        parsed = value
    return name, parsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pacer try", description="Try engine arguments on one worker as a canary (judged against the others)."
    )
    add_connection_args(parser)
    parser.add_argument("--worker", required=True, help="the worker id (see pacer status)")
    parser.add_argument(
        "--args", action="append", required=True, type=parse_assignment, metavar="NAME=VALUE",
        help="an engine argument with underscores (repeat for several)",
    )  # fmt: skip
    parser.add_argument("--note", default="", help="why, for the journal")
    parser.add_argument("--json", action="store_true", help="print the proxy's answer as JSON")
    args = parser.parse_args(argv)
    client = AdminClient.from_args(args)
    try:
        answer = client.post("/admin/trial", {"worker": args.worker, "args": dict(args.args), "note": args.note})
    except AdminError as exc:
        print(f"pacer try: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps(answer).decode())
        return 0
    tried = ", ".join(f"{k}={v}" for k, v in answer["args"].items())
    print(
        f"trial #{answer['entry']} on {answer['worker']}: {tried}; judged {answer['judged_after_s']:g} s after it"
        f" serves (follow: pacer decisions --worker {answer['worker']})"
    )
    return 0
