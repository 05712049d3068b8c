"""Functions over 80 lines in ``proxy/``: the house rule is a function a reader holds in one screen.

A function's lines run from its ``def`` to its last line (decorators aside; a nested function
counts in its own and in its parent's). Classes and module-level tables are declarations and are
not counted. Today's offenders are listed in ``tools/allowed/long_functions.txt`` (key
``path::Qualified.name``); any other fails, and so does a listed one that is now short.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from tools.ratchet import key_of, python_files, report

MAX_LINES = 80


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function in ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, name + ".")
        else:
            yield from functions(node, prefix)


def long_functions(root: Path, max_lines: int = MAX_LINES) -> dict[str, str]:
    """Key -> printed line, for each function under ``root`` over ``max_lines`` lines."""
    found = {}
    for path in python_files(root):
        for name, node in functions(ast.parse(path.read_text(), str(path))):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > max_lines:
                where = key_of(path, root)
                found[f"{where}::{name}"] = f"{lines:4d} lines  {where}:{node.lineno} {name}"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("proxy"))
    parser.add_argument("--allow", type=Path, default=Path("tools/allowed/long_functions.txt"))
    args = parser.parse_args(argv)
    return report(f"functions over {MAX_LINES} lines", long_functions(args.root), args.allow)


if __name__ == "__main__":
    sys.exit(main())
