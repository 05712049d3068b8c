"""Why a worker process ended, in one short line for the operator: how it ended and what it said.

A dying process says why at the end of its output, after whatever came before (argparse prints
its usage, then ``prog: error: ...``; Python prints a traceback, then ``SomeError: ...``). So the
line quotes the process's error lines when it printed some, else its last lines; and text too long
for where it is shown is cut at its front, never at its end (:func:`keep_end`).

These are conventions of command-line programs and of Python, not of one engine: an engine's own
reading of a death (OOM, crash, start-up refusal) is its module's ``classify_death``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.workers.process import EXIT_UNKNOWN, signal_name

CUT_MARK = "…"
ERROR_LINES_QUOTED = 2  # the last error lines a summary quotes (a chained exception's two ends)
LAST_LINES_QUOTED = 8  # the last lines it quotes when none of them reads as an error
ENDING_LINES = 100  # the lines of a run's end its error lines are looked for in (chained tracebacks fit)
SUMMARY_CHARS = 2000

# "prog: error: unrecognized arguments: ...", "ERROR: ...", or a Python exception's last line,
# "ValueError: ...", "torch.OutOfMemoryError: ...": an exception name (…Error, …Exception) then ": "
# or the line's end (a bare "AssertionError")
_ERROR_LINE = re.compile(r"(?i:\berror: \S)|\b\w*(?:Error|Exception)(?:: \S|$)")


def keep_end(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: its end, after :data:`CUT_MARK` where its front was cut."""
    if len(text) <= limit:
        return text
    if limit <= len(CUT_MARK):
        return text[len(text) - limit :] if limit > 0 else ""
    return CUT_MARK + text[len(text) - limit + len(CUT_MARK) :]


def shorten_cause(cause: str, limit: int) -> str:
    """A cause in words, ``how: what it said`` (:func:`describe_exit`'s shape), in at most ``limit``
    characters: its head (how it ended: "killed by SIGKILL") kept whole and what follows cut at its
    front; a cause without that shape, or too short a limit for its head, as :func:`keep_end` cuts it."""
    how, sep, said = cause.partition(": ")
    if len(cause) <= limit or not sep or len(how) + len(sep) + len(CUT_MARK) + 1 > limit:
        return keep_end(cause, limit)
    return how + sep + keep_end(said, limit - len(how) - len(sep))


def error_lines(lines: Sequence[str]) -> list[str]:
    """The lines of ``lines`` that read as an error (stripped), in order."""
    return [line.strip() for line in lines if _ERROR_LINE.search(line)]


def how_it_ended(code: int) -> str:
    if code == EXIT_UNKNOWN:
        return "ended (adopted from an earlier proxy: its exit code is not known)"
    return f"killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"


def what_it_said(lines: Sequence[str], limit: int = SUMMARY_CHARS, *, errors: bool = True) -> str:
    """What output ``lines`` (one run's, oldest first) said last: with ``errors``, the error lines of
    its end (its last :data:`ENDING_LINES`: an error a healthy engine logged long before, a request
    it refused, is not why it ended); else, or with none, its last lines. Joined
    by `` | `` in at most ``limit`` characters, cut at the front ("" when it said nothing)."""
    said = [line.strip() for line in lines if line.strip()]
    quoted = (error_lines(said[-ENDING_LINES:])[-ERROR_LINES_QUOTED:] if errors else []) or said[-LAST_LINES_QUOTED:]
    return keep_end(" | ".join(quoted), max(limit, len(CUT_MARK) + 1)) if quoted else ""


def describe_exit(code: int, lines: Sequence[str], limit: int = SUMMARY_CHARS) -> str:
    """How a process ended (exit ``code``, negative for a signal) and :func:`what_it_said`, at most
    ``limit`` characters in all."""
    how = how_it_ended(code)
    head = f"{how}: "
    said = what_it_said(lines, limit - len(head), errors=code >= 0)  # a signal: what it was doing, as it was
    return head + said if said else how
