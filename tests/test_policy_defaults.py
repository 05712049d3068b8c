"""The documented defaults agree with the declarations: ``pacer check-policy --defaults`` reads back
as the default policy, and every key ``policies/default.toml`` shows (set or commented out) has the
declared default, but for the few the file says it changes."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.policy import TABLES, Policy, PoolKeys, documented_defaults, load_policy, parse_policy
from proxy.policy_schema import key_doc

DEFAULT_TOML = Path(__file__).parents[1] / "policies" / "default.toml"
# keys default.toml sets to other values than the defaults, and says so in its comments
CHANGED_IN_DEFAULT_TOML = {
    ("engine", "args"),
    ("engine", "extra_args"),
    ("engine", "startup_timeout_s"),
}
COMMENTED_KEY = re.compile(r"^# (\w+ = .*?)\s*(?:#.*)?$")


def declared_default(table: str, name: str) -> Any:
    return getattr(getattr(Policy(), table), name)


def as_toml(value: Any) -> Any:
    if isinstance(value, tuple):
        return [as_toml(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def shown_keys(path: Path) -> dict[tuple[str, str], Any]:
    """Every key the file sets, and every ``# key = value`` line it shows commented out, by table."""
    shown: dict[tuple[str, str], Any] = {}
    table = ""
    for line in path.read_text().splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            table = m.group(1)
        elif m := COMMENTED_KEY.match(line):
            ((name, value),) = tomllib.loads(m.group(1)).items()
            shown[(table, name)] = value
    for table, keys in tomllib.loads(path.read_text()).items():
        shown.update({(table, name): value for name, value in keys.items()})
    return shown


def test_every_key_has_a_declaration() -> None:
    assert set(TABLES) == {f.name for f in dataclasses.fields(Policy)} - {"source", "pools"}
    for f in dataclasses.fields(PoolKeys):
        assert key_doc(f).doc, f"pool.{f.name}"
    for table, settings in TABLES.items():
        for f in dataclasses.fields(settings):
            assert key_doc(f).doc, f"{table}.{f.name}"


def test_the_defaults_document_reads_back_as_the_default_policy() -> None:
    doc = tomllib.loads(documented_defaults())
    (pool,) = doc.pop("pool")  # [[pool]] replaces [engine]: its keys beside every engine key
    pool_section = documented_defaults().split("[[pool]]")[1]
    assert {m.group(1) for m in re.finditer(r"^(?:# )?(\w+) = ", pool_section, re.M)} == {
        f.name for f in dataclasses.fields(PoolKeys)
    }
    assert pool == {"name": "default", "tp": 1}
    assert set(doc) == set(TABLES) and doc["auth"] == {}  # no auth key is set by default: all commented out
    for table, settings in TABLES.items():
        section = documented_defaults().split(f"[{table}]\n")[1].split("\n[")[0]
        shown = {m.group(1) for m in re.finditer(r"^(?:# )?(\w+) = ", section, re.M)}
        assert shown == {f.name for f in dataclasses.fields(settings)}, table
    # urls and speaks are for kind = "external" only (the reader rejects them for the default "sim")
    del doc["engine"]["urls"], doc["engine"]["speaks"]
    assert parse_policy(doc, "<defaults>", base_dir=Path.cwd()) == Policy()


def test_pacer_check_policy_defaults_prints_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-policy", "--defaults"]) == 0
    assert capsys.readouterr().out == documented_defaults()


def test_default_toml_shows_the_declared_defaults() -> None:
    shown = shown_keys(DEFAULT_TOML)
    wrong = {
        f"{table}.{name}": (value, as_toml(declared_default(table, name)))
        for (table, name), value in shown.items()
        if (table, name) not in CHANGED_IN_DEFAULT_TOML and value != as_toml(declared_default(table, name))
    }
    assert not wrong, wrong
    assert {
        key for key in CHANGED_IN_DEFAULT_TOML if shown[key] != as_toml(declared_default(*key))
    } == CHANGED_IN_DEFAULT_TOML


@pytest.mark.parametrize("table", ["proxy", "queue", "pacing", "control", "batch", "admission"])
def test_default_toml_shows_every_key_of(table: str) -> None:
    shown = {name for (t, name) in shown_keys(DEFAULT_TOML) if t == table}
    assert shown == {f.name for f in dataclasses.fields(TABLES[table])}


@pytest.mark.parametrize("path", sorted(DEFAULT_TOML.parent.glob("*.toml")), ids=lambda p: p.name)
def test_the_changed_keys_check_policy_prints_rebuild_the_policy(path: Path) -> None:
    """(with [[pool]] tables: the top-level keys, then one [[pool]] table per pool)"""
    policy = load_policy(path)
    rebuilt = parse_policy(tomllib.loads("\n".join(policy.changed())), policy.source, base_dir=path.parent)
    assert rebuilt == policy


def test_the_changed_keys_mask_secrets(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        '[engine]\nargs = { api_key = "sekrit", max_running_requests = 8 }\nenv = { HF_TOKEN = "hf_x" }\n'
        "[pacing]\nheadroom = 4\n"
    )
    assert main(["check-policy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sekrit" not in out and "hf_x" not in out
    assert load_policy(path).changed() == [
        'engine.args = { api_key = "***", max_running_requests = 8 }',
        'engine.env = { HF_TOKEN = "***" }',
        "pacing.headroom = 4",
    ]


def test_a_pooled_policy_s_changed_keys_rebuild_it_with_each_pool_s_overrides(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        '[pacing]\nheadroom = 4\n[control]\nmode = "advise"\nrestarts_per_hour = 5\n'
        '[[pool]]\nname = "a"\nmodel = "ma"\nkind = "external"\nurls = ["http://h:1", "http://h:2"]\n'
        '[pool.pacing]\nqueue_band = [8, 96]\n[pool.control]\nmode = "auto"\nrestarts_per_hour = 5\n'
        '[[pool]]\nname = "b"\nmodel = "mb"\ntp = 2\ngpus = [0, 1]\nenv = { HF_TOKEN = "hf_x" }\n'
    )
    policy = load_policy(path)
    changed = policy.changed()
    assert changed[: changed.index("[[pool]]")] == ['pacing.headroom = 4', 'control.mode = "advise"',
                                                    "control.restarts_per_hour = 5"]  # fmt: skip
    a = changed[changed.index('name = "a"') :]
    assert "pacing.queue_band = [8, 96]" in a and 'control.mode = "auto"' in a
    assert not any(c.startswith("control.restarts_per_hour") for c in a)  # as [control] has it: not repeated
    assert 'env = { HF_TOKEN = "***" }' in changed and "hf_x" not in "\n".join(changed)
    rebuilt = parse_policy(tomllib.loads("\n".join(changed).replace('"***"', '"hf_x"')), policy.source)
    assert rebuilt == policy


def test_the_changed_keys_of_per_key_tables_rebuild_the_policy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "keys.txt").write_text("k1 name=bob\nk2 name=carol\n")
    path = tmp_path / "p.toml"
    path.write_text(
        '[auth]\napi_keys_file = "keys.txt"\n'
        "[admission.keys.bob]\nrequests_per_minute = 2\nweight = 3.0\n[admission.keys.carol]\n"
    )
    assert main(["check-policy", str(path)]) == 0  # it had stopped on a TypeError
    assert "admission.keys = { bob = { weight = 3.0, requests_per_minute = 2 }, carol = {} }" in capsys.readouterr().out
    policy = load_policy(path)
    assert parse_policy(tomllib.loads("\n".join(policy.changed())), policy.source) == policy
