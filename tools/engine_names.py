"""Engine names outside the engines: SGLang's and vLLM's names and flags belong in
``proxy/engines/`` and ``proxy/sim/``; the rest of ``proxy/`` speaks in engine-neutral terms
(knobs, samples, the engine contract), so a new engine or a renamed flag is one package's change.

Looked for in code, not prose: identifiers (any case) and string literals (lower case, as a flag,
module or metric name is written) that name ``sglang`` or ``vllm``, hold ``--sim-``, or name an
argument one of the engines' knobs moves (``mem_fraction_static``, ``max_num_seqs``...). Comments
and docstrings are prose and not read. Today's offenders are listed in
``tools/allowed/engine_names.txt`` (``path: name``); any other fails, and so does a listed one gone.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path

from tools.ratchet import key_of, python_files, report

ENGINE_HOMES = ("engines", "sim")  # the packages under the root that may name the engines
WORDS = ("sglang", "vllm")
SIM_FLAG = "--sim-"


def knob_args() -> set[str]:
    """The arguments the engines' knobs move, as the engines' own tables name them."""
    from proxy.engines.registry import ENGINES

    knobs = (knob for engine in ENGINES.values() for knob in engine.knobs.values())
    return {name for knob in knobs for name in (knob.arg, knob.resolved_field) if name}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def names_in(source: str, args: Iterable[str]) -> dict[str, list[int]]:
    """Engine name -> the lines of ``source`` naming it in code."""
    words = "|".join([*WORDS, *sorted(args)])
    in_string = re.compile(rf"\b({words})\b(?!-pacer)|" + re.escape(SIM_FLAG))  # the project's own name aside
    in_name = re.compile(r"(" + "|".join(WORDS) + r")|^(" + "|".join(sorted(args)) + r")$", re.IGNORECASE)
    strings = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    prose = _docstring_lines(ast.parse(source))
    found: dict[str, list[int]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            hits = [m.group(0).lower() for m in in_name.finditer(tok.string)]
        elif tok.type in strings and tok.start[0] not in prose:
            hits = [m.group(0) for m in in_string.finditer(tok.string)]
        else:
            continue
        for hit in hits:
            found.setdefault(hit, []).append(tok.start[0])
    return found


def engine_names(root: Path, args: Iterable[str]) -> dict[str, str]:
    """``path: name`` -> printed line, for each engine name in code under ``root`` outside the engines."""
    homes = [root / home for home in ENGINE_HOMES]
    found = {}
    for path in python_files(root):
        if any(path.is_relative_to(home) for home in homes):
            continue
        for name, lines in names_in(path.read_text(), args).items():
            key = f"{key_of(path, root)}: {name}"
            found[key] = f"{key}  (line {', '.join(map(str, sorted(set(lines))))})"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("proxy"))
    parser.add_argument("--allow", type=Path, default=Path("tools/allowed/engine_names.txt"))
    args = parser.parse_args(argv)
    return report("engine names outside the engines", engine_names(args.root, knob_args()), args.allow)


if __name__ == "__main__":
    sys.exit(main())
