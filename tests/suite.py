"""``make test``: every test, in two parts.

First the tests that need no real engine, over two processes, while the engine environments that the
cache lacks build in the background at the lowest CPU priority (tests/real/prebuild.py). Then the
slow tests, one at a time: a real vLLM or SGLang on the CPU takes every core, and a test beside it
would wait for one. Arguments go to both pytest runs; the exit status is the first part's failure,
else the second's.
"""

from __future__ import annotations

import subprocess
import sys

from tests.real.envs import RECIPES
from tests.real.prebuild import Build, built

PARALLEL = ("-n", "2", "--dist", "worksteal", "-m", "not slow")
SERIAL = ("-m", "slow")


def _pytest(args: tuple[str, ...], extra: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", "-q", *args, *extra])


def main(extra: list[str]) -> int:
    lacking = [name for name in RECIPES if not built(name)]
    build = Build.start(lacking) if lacking else None
    try:
        first = _pytest(PARALLEL, extra)
        if build is not None and (failure := build.wait()) is not None:
            print(failure, file=sys.stderr)  # the slow tests' fixtures build what is still missing
        second = _pytest(SERIAL, extra)
    finally:
        if build is not None:
            build.finish()
    return first or second


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
