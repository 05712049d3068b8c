"""Module docstrings over 25 lines in ``proxy/``: a module says what it is and why in a few lines;
the rest belongs in the docs, where figures do not go stale in code.

A docstring's lines run from its opening quotes to its closing ones. Today's offenders are listed
in ``tools/allowed/long_docstrings.txt`` (one path each); any other fails, and so does a listed one
that is now short.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from tools.ratchet import key_of, python_files, report

MAX_LINES = 25


def docstring_lines(source: str) -> int:
    """The lines of the module docstring of ``source`` (0: none)."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def long_docstrings(root: Path, max_lines: int = MAX_LINES) -> dict[str, str]:
    """Path -> printed line, for each module under ``root`` whose docstring is over ``max_lines``."""
    found = {}
    for path in python_files(root):
        lines = docstring_lines(path.read_text())
        if lines > max_lines:
            found[key_of(path, root)] = f"{lines:4d} lines  {key_of(path, root)}"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("proxy"))
    parser.add_argument("--allow", type=Path, default=Path("tools/allowed/long_docstrings.txt"))
    args = parser.parse_args(argv)
    return report(f"module docstrings over {MAX_LINES} lines", long_docstrings(args.root), args.allow)


if __name__ == "__main__":
    sys.exit(main())
