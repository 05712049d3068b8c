"""``pacer decisions``: the controller's journal from a running proxy's ``/admin/decisions``,
filtered by worker, rule, status and age; ``--json`` prints the entries as JSON lines."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import orjson

from proxy.console.admin import AdminClient, AdminError, add_connection_args, count

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: datetime) -> datetime:
    """``90s``, ``15m``, ``2h``, ``1d`` ago, or an ISO time (UTC when it names no zone)."""
    match = _DURATION.match(text.strip())
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since takes a duration (90s, 15m, 2h, 1d) or an ISO time, got {text!r}"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _gain(entry: Mapping[str, Any], name: str) -> object:
    if name in entry:
        return entry[name]
    outcome = entry.get("outcome") or {}
    return outcome.get(name) if isinstance(outcome, Mapping) else None


def _percent(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:+.1%}"


def gain_text(e: Mapping[str, Any]) -> str:
    """The entry's predicted and measured gain (an output budget's: whether it met the prediction within
    the twin's error, or why there is no figure), as `` gain predicted +x% measured +y%...``; "" where
    it has neither."""
    predicted, measured = _gain(e, "predicted_gain"), _gain(e, "measured_gain")
    missing = [f"{what}: {e[key]}" for what, key in (("not predicted", "not_predicted"),
                                                     ("not measured", "not_measured")) if e.get(key)]  # fmt: skip
    if predicted is None and measured is None and not missing:
        return ""
    text = f" gain predicted {_percent(predicted)} measured {_percent(measured)}"
    met, tolerance = e.get("met_prediction"), e.get("prediction_tolerance")
    if isinstance(met, bool):
        within = "within" if met else "outside"
        text += (
            f" ({within} the twin's error" + (f", {tolerance:.1%}" if isinstance(tolerance, (int, float)) else "") + ")"
        )
    return text + "".join(f" · {m}" for m in missing)


def local_time(text: str) -> str:
    """The journal's ISO time (UTC) as this machine's local time with its zone, as the dashboard shows
    it; a time that does not parse is printed as it came."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return text
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_decision(e: Mapping[str, Any]) -> str:
    changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in (e.get("changes") or {}).items())
    when = local_time(str(e.get("time", "")))
    text = f"#{e.get('id')} {when} {e.get('worker')} {e.get('rule')} [{e.get('status')}]"
    if e.get("replica"):  # a shared store's journal: the replica that decided
        text = f"{e['replica']} {text}"
    if changes:
        text += f" {changes}"
    text += gain_text(e)
    error = e.get("prediction_error")
    if isinstance(error, (int, float)):  # the plan's twin on the requests served under its args
        basis = e.get("prediction_basis", "throughput")
        text += (f" · twin {error:.1%} off on {basis} (predicted {e.get('predicted_outcome')}, "
                 f"measured {e.get('measured_outcome')} over {e.get('outcome_requests')} requests)")  # fmt: skip
        answers = e.get("answer_error")
        if isinstance(answers, (int, float)):
            text += f", {answers:.1%} on answer times"
    outcome = e.get("outcome") or {}
    if isinstance(outcome, Mapping) and outcome.get("verdict"):
        text += f" ({outcome['verdict']})"
    return text + f": {e.get('reason', '')}" + (f" ({e['detail']})" if e.get("detail") else "")


def select(
    entries: list[Mapping[str, Any]], *, rule: str | None, status: str | None, since: datetime | None
) -> list[Mapping[str, Any]]:
    out = []
    for e in entries:
        if rule is not None and e.get("rule") != rule:
            continue
        if status is not None and e.get("status") != status:
            continue
        if since is not None:
            try:
                when = datetime.fromisoformat(str(e.get("time")))
            except ValueError:
                continue
            if when < since:
                continue
        out.append(e)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pacer decisions", description="The controller's journal of a running proxy.")
    add_connection_args(parser)
    parser.add_argument("--worker", help="only this worker's decisions")
    parser.add_argument("--rule", help="only this rule's (e.g. retraction_storm)")
    parser.add_argument(
        "--status",
        choices=["advised", "refused", "noted", "acting", "applied", "revived", "failed"],
        help="only this status",
    )
    parser.add_argument("--since", help="only newer than a duration ago (90s, 15m, 2h, 1d) or an ISO time")
    parser.add_argument("--limit", type=count, help="at most the newest N after filtering")
    parser.add_argument("--json", action="store_true", help="one JSON object per line, the journal's own fields")
    args = parser.parse_args(argv)
    try:
        since = parse_since(args.since, datetime.now(UTC)) if args.since else None
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    client = AdminClient.from_args(args)
    query = urlencode({"worker": args.worker} if args.worker else {})
    try:
        body = client.get("/admin/decisions" + (f"?{query}" if query else ""))
    except AdminError as exc:
        print(f"pacer decisions: {exc}", file=sys.stderr)
        return 1
    entries = select(body.get("decisions", []), rule=args.rule, status=args.status, since=since)
    if args.limit is not None and args.limit >= 0:
        entries = entries[-args.limit :] if args.limit else []
    if args.json:
        for e in entries:
            sys.stdout.write(orjson.dumps(e).decode() + "\n")
        return 0
    print(f"controller {body.get('mode', '?')}: {len(entries)} decision(s)")
    for e in entries:
        print(format_decision(e))
    return 0
