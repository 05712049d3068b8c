"""``pacer status``: the workers, the queues, each worker's args and the last decisions, from a
running proxy's ``/admin/workers`` and ``/admin/decisions``; ``--watch`` redraws every few seconds."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from proxy.console.admin import AdminClient, AdminError, add_connection_args, count
from proxy.console.decisions import format_decision


def _num(value: object, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "-" if value is None else str(value)


_WHY_CHARS = 240  # a death's cause quotes the end of the worker's output: its first words say what happened


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_status(workers: Mapping[str, Any], decisions: Mapping[str, Any], last: int) -> str:
    queue = workers.get("proxy_queue", {})
    lines = [
        f"controller {decisions.get('mode', '?')} · proxy queue "
        + ", ".join(f"{k} {v}" for k, v in queue.items())
        + f" · in flight {workers.get('in_flight', 0)}",
        "",
        f"{'worker':<8} {'state':<9} {'queue':>6} {'running':>8} {'usage':>6} {'tok/s':>8} {'inflight':>8} "
        f"{'restarts':>8}  url",
    ]
    for w in workers.get("workers", []):
        s = w.get("sample") or {}
        state = w.get("state", "?") + ("" if w.get("fresh", True) or not s else "*")
        lines.append(
            f"{w['id']:<8} {state:<9} {_num(s.get('queue')):>6} {_num(s.get('running')):>8} "
            f"{_num(s.get('token_usage')):>6} {_num(w.get('output_rate'), 0):>8} {_num(w.get('in_flight')):>8} "
            f"{_num(w.get('restarts')):>8}  {w.get('url', '')}"
        )
        args = " ".join(f"{k}={orjson.dumps(v).decode()}" for k, v in (w.get("args") or {}).items())
        lines.append(f"{'':<8} args: {args or '(none)'}")
        if w.get("state") != "ready" and w.get("last_error"):  # why it is not serving: the pool's words
            lines.append(f"{'':<8} why: {_clip(str(w['last_error']), _WHY_CHARS)}")
    journal: Sequence[Mapping[str, Any]] = decisions.get("decisions", [])
    entries = journal[-last:] if last > 0 else []
    lines.append("")
    if entries:
        lines.append(f"last decisions ({len(entries)} shown):")
    else:
        lines.append("decisions not shown (--last 0)" if journal else "no decisions yet")
    lines.extend("  " + format_decision(e) for e in entries)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer status", description="Show a running proxy's workers and decisions.")
    add_connection_args(parser)
    parser.add_argument("--last", type=count, default=5, help="how many of the newest decisions to show (default 5)")
    parser.add_argument("--watch", action="store_true", help="redraw until interrupted (an unreachable proxy too)")
    parser.add_argument(
        "--interval", type=_seconds, default=2.0, help="seconds between redraws with --watch (default 2)"
    )
    parser.add_argument("--json", action="store_true", help="print the raw workers and decisions as JSON")
    args = parser.parse_args(argv)
    client = AdminClient.from_args(args)
    try:
        while True:
            try:
                workers = client.get("/admin/workers")
                decisions = client.get(f"/admin/decisions?limit={max(args.last, 1)}")
            except AdminError as exc:
                if not args.watch:
                    raise
                text = f"pacer status: {exc}; trying again in {args.interval:g} s"  # a watch waits it out
            else:
                if args.json:
                    text = orjson.dumps(
                        {"workers": workers, "decisions": decisions}, option=orjson.OPT_INDENT_2
                    ).decode()
                else:
                    text = format_status(workers, decisions, args.last)
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(text, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
            if not sys.stdout.isatty():
                print("", flush=True)
    except AdminError as exc:
        print(f"pacer status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value
