"""The cached environments' plumbing, without building one: SGLang's environment takes the files of
torch and triton from vLLM's as hard links (what their ``RECORD`` lists, scripts left out), and the
session's background build says what it needs, stops with the session, and says why it failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.real.envs import SGLANG, VLLM_CPU, env_dir_of, link_distributions, tiny_model_dir
from tests.real.prebuild import Build, missing


def _install(site: Path, name: str, files: dict[str, bytes]) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    rows = [f'"{rel}",sha256=x,{len(data)}' for rel, data in files.items()]
    for rel, data in files.items():
        if not rel.startswith(".."):
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)
    (info / "RECORD").write_text("\n".join([*rows, f"{info.name}/RECORD,,"]) + "\n")


def test_the_named_distributions_are_hard_linked_but_their_scripts(tmp_path: Path) -> None:
    donor, site = tmp_path / "donor", tmp_path / "env"
    _install(donor, "torch", {"torch/__init__.py": b"x", "torch/lib/a, b.so": b"so", "../../../bin/torchrun": b"#!"})
    _install(donor, "torchvision", {"torchvision/__init__.py": b"y"})
    site.mkdir()

    assert link_distributions(donor, site, ("torch", "triton")) == ["torch-1.0.dist-info"]

    for rel in ("torch/__init__.py", "torch/lib/a, b.so", "torch-1.0.dist-info/RECORD"):
        assert (site / rel).stat().st_ino == (donor / rel).stat().st_ino, rel
    assert not (site / "torchvision").exists()
    assert not (tmp_path / "bin").exists()


def _items(*fixtures: str) -> list:
    return [SimpleNamespace(fixturenames=["tmp_path", name]) for name in fixtures]


def test_the_build_is_of_what_the_tests_need_and_the_cache_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PACER_CACHE_DIR", str(tmp_path))
    assert missing(_items("sglang_python", "tiny_model")) == ["vllm", "sglang"]
    assert missing(_items("tmp_path")) == []
    for recipe in (VLLM_CPU, SGLANG):
        env_dir_of(recipe).mkdir(parents=True)
        (env_dir_of(recipe) / ".complete").write_text(recipe.fingerprint())
    assert missing(_items("vllm_python", "sglang_python")) == ["vllm"]  # the tiny model is built with vLLM's
    tiny_model_dir().mkdir(parents=True)
    (tiny_model_dir() / ".complete").write_text("")
    assert missing(_items("vllm_python", "sglang_python")) == []


def _build(tmp_path: Path, code: str) -> Build:
    log = tmp_path / "build.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True
        )
    return Build(proc, log, ("vllm",))


def test_a_build_still_running_at_the_end_is_stopped_and_said_so(tmp_path: Path) -> None:
    build = _build(tmp_path, "import os\nwhile os.read(0, 4096):\n    pass")  # ends when its input closes
    said = build.finish()
    assert said is not None and "stopped at the session's end, unfinished" in said
    assert build.proc.returncode is not None


def test_a_failed_build_says_how_with_its_log(tmp_path: Path) -> None:
    build = _build(tmp_path, "print('pip says no', flush=True); raise SystemExit(3)")
    said = build.wait()
    assert said is not None and "(vllm) failed (exit 3)" in said and "pip says no" in said
    assert build.finish() == said
    assert (tmp_path / "build.log").exists()  # kept for reading


def test_a_build_that_built_everything_says_nothing_and_leaves_no_log(tmp_path: Path) -> None:
    build = _build(tmp_path, "pass")
    assert build.wait() is None
    assert build.finish() is None
    assert not (tmp_path / "build.log").exists()
