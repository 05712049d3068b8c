"""The lint checks of ``tools/`` on tiny trees: what each reports, what it leaves, and its
allow-list (a new offender fails, a listed one passes, a listed one fixed fails until removed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tools import engine_names, long_docstrings, long_functions


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """``files`` (path under ``proxy/`` -> source) written out; returns the ``proxy`` folder."""
    root = tmp_path / "proxy"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def function(name: str, lines: int, indent: str = "") -> str:
    """A function of ``lines`` lines, its ``def`` line included."""
    return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (lines - 1)


def allow(tmp_path: Path, *keys: str) -> Path:
    path = tmp_path / "allowed.txt"
    path.write_text("# today's offenders\n\n" + "".join(k + "\n" for k in keys))
    return path


def test_a_function_of_81_lines_is_reported_one_of_80_is_not(tmp_path: Path) -> None:
    class_of_constants = "class Table:\n" + "    X = 1\n" * 100  # a declaration, not a function
    method = "class Pool:\n" + function("run", 81, "    ")
    nested = function("outer", 5) + function("inner", 81, "    ")
    root = tree(
        tmp_path, {"a.py": function("short", 80) + function("long", 81), "b/c.py": class_of_constants + method + nested}
    )
    found = long_functions.long_functions(root)
    assert sorted(found) == [
        "proxy/a.py::long",
        "proxy/b/c.py::Pool.run",
        "proxy/b/c.py::outer",
        "proxy/b/c.py::outer.inner",
    ]
    assert found["proxy/a.py::long"] == "  81 lines  proxy/a.py:81 long"


def test_the_allow_list_passes_its_offenders_fails_a_new_one_and_a_fixed_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tree(tmp_path, {"a.py": function("long", 81)})
    run = ["--root", str(root), "--allow"]
    assert long_functions.main([*run, str(allow(tmp_path, "proxy/a.py::long"))]) == 0
    assert "81 lines  proxy/a.py:1 long" in capsys.readouterr().out  # printed, listed or not
    assert long_functions.main([*run, str(allow(tmp_path))]) == 1
    assert "proxy/a.py:1 long  <- new" in capsys.readouterr().out
    (root / "a.py").write_text(function("long", 80))
    assert long_functions.main([*run, str(allow(tmp_path, "proxy/a.py::long"))]) == 1
    assert "proxy/a.py::long  <- fixed: remove it" in capsys.readouterr().out


def test_a_module_docstring_of_26_lines_is_reported_one_of_25_is_not(tmp_path: Path) -> None:
    def docstring(lines: int) -> str:
        return '"""' + "text\n" * (lines - 1) + '"""\n\nX = 1\n'

    root = tree(tmp_path, {"a.py": docstring(25), "b.py": docstring(26), "c.py": "X = 1\n", "d.py": ""})
    assert long_docstrings.long_docstrings(root) == {"proxy/b.py": "  26 lines  proxy/b.py"}
    assert long_docstrings.main(["--root", str(root), "--allow", str(allow(tmp_path, "proxy/b.py"))]) == 0


def test_engine_names_in_code_outside_the_engines_are_reported(tmp_path: Path) -> None:
    source = textwrap.dedent(
        '''\
        """Prose may say sglang and mem_fraction_static."""

        from proxy.engines.sglang import SGLANG  # a comment may say vllm

        NAME = "sglang-pacer"  # the project's own name
        HELP = "SGLang's scheduler"  # prose, as written for a reader
        ARGS = ["--sim-gpu", "h100"]


        def limit(args):
            """A docstring may say --sim-model."""
            return args.get("mem_fraction_static"), args.max_num_seqs_floor
        '''
    )
    engine_code = 'KIND = "sglang"\nARG = "mem_fraction_static"\n'
    root = tree(tmp_path, {"control/a.py": source, "engines/sglang/b.py": engine_code, "sim/c.py": engine_code})
    found = engine_names.engine_names(root, {"mem_fraction_static", "max_num_seqs"})
    assert found == {
        "proxy/control/a.py: sglang": "proxy/control/a.py: sglang  (line 3)",
        "proxy/control/a.py: --sim-": "proxy/control/a.py: --sim-  (line 7)",
        "proxy/control/a.py: mem_fraction_static": "proxy/control/a.py: mem_fraction_static  (line 12)",
    }


def test_the_engine_arguments_come_from_the_engines_knob_tables() -> None:
    names = engine_names.knob_args()
    assert {"schedule_conservativeness", "chunked_prefill_size", "mem_fraction_static", "max_num_seqs"} <= names
