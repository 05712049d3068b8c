"""The allow-list the lint checks share: today's offenders named in a file, so the list only shrinks.

A check finds its offenders, each with a key and a line to print. A key not in the list fails the
check; so does a listed key that no longer offends (remove it, so a fixed offender cannot come
back unseen). Lines of the list: one key each; blank lines and ``#`` comments are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path


def read_allowed(path: Path) -> set[str]:
    if not path.exists():
        return set()
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def python_files(root: Path) -> Iterator[Path]:
    """Every ``.py`` file under ``root``, in a stable order."""
    yield from sorted(root.rglob("*.py"))


def key_of(path: Path, root: Path) -> str:
    """``path`` as the allow-lists name it: from the folder holding ``root`` (``proxy/...``)."""
    return path.relative_to(root.parent).as_posix()


def report(title: str, found: Mapping[str, str], allow: Path) -> int:
    """Print every offender (``found``: key -> its line) and what the allow-list says of it; 1 when
    one is new or a listed one is fixed, else 0."""
    allowed = read_allowed(allow)
    new = set(found) - allowed
    fixed = sorted(allowed - set(found))
    print(f"{title}: {len(found)}, {len(found) - len(new)} of them listed in {allow}")
    for key in sorted(found):
        print(f"  {found[key]}" + ("  <- new: fix it" if key in new else ""))
    for key in fixed:
        print(f"  {key}  <- fixed: remove it from {allow}")
    return 1 if new or fixed else 0
