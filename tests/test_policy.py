"""Policy files: every shipped policy loads, defaults are sane, and each bad value names its key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from proxy.policy import (
    ControlMode,
    EngineKind,
    Policy,
    PolicyError,
    Priority,
    load_policy,
    parse_policy,
)

POLICIES = sorted((Path(__file__).parents[1] / "policies").glob("*.toml"))


def test_there_are_policies() -> None:
    assert {p.name for p in POLICIES} >= {"default.toml", "offline-batch.toml", "online-chat.toml"}


@pytest.mark.parametrize("path", POLICIES, ids=lambda p: p.name)
def test_every_shipped_policy_loads_and_describes(path: Path) -> None:
    policy = load_policy(path)
    assert policy.source == str(path)
    text = policy.describe()
    assert str(path) in text and f"queue band [{policy.pacing.queue_band[0]}, " in text


def test_default_policy_is_what_make_run_needs() -> None:
    p = load_policy(Path(__file__).parents[1] / "policies" / "default.toml")
    assert p.engine.kind == EngineKind.SIM and p.engine.workers == 1 and p.engine.managed
    assert list(p.engine.extra_args) == ["--sim-time-scale", "10", "--sim-gpu", "a100-40gb"]
    # the product as it is meant to run: the controller acts on the simulated worker
    assert p.control.mode == ControlMode.AUTO and not p.auth.configured


def test_offline_and_online_differ_where_they_should() -> None:
    root = Path(__file__).parents[1] / "policies"
    offline, online = load_policy(root / "offline-batch.toml"), load_policy(root / "online-chat.toml")
    assert offline.pacing.queue_band == (100, 2000) and offline.queue.default_priority == Priority.BATCH
    assert online.pacing.queue_band[1] <= 500 and online.queue.default_priority == Priority.INTERACTIVE
    assert offline.queue.capacity > online.queue.capacity


def test_empty_policy_has_defaults() -> None:
    p = parse_policy({}, "<empty>")
    assert p == Policy(source="<empty>")
    assert p.proxy.port == 8000 and p.queue.capacity == 20000 and p.pacing.queue_band == (100, 2000)
    assert p.engine.kind == "sim" and p.engine.base_port == 0 and p.engine.log_dir == Path(".pacer/logs")


def test_full_example_from_the_schema(tmp_path: Path) -> None:
    text = """
[proxy]
host = "0.0.0.0"
port = 9000
[auth]
api_keys_env = "PACER_API_KEYS"
api_keys_file = "keys.txt"
admin_key_file = "secret/admin.key"
[queue]
default_priority = "batch"
priority_header = "X-Pacer-Priority"
[engine]
kind = "sglang"
workers = 2
args = { model_path = "/m", schedule_conservativeness = 1.0, max_running_requests = 256 }
extra_args = ["--attn-dp-size", "2"]
command = ["python3", "-m", "sglang.launch_server"]
base_port = 30000
env = { CUDA_VISIBLE_DEVICES = "0" }
[pacing]
queue_band = [50, 500]
[control]
mode = "advise"
"""
    path = tmp_path / "p.toml"
    path.write_text(text)
    p = load_policy(path)
    assert p.auth.api_keys_file == tmp_path / "keys.txt"  # relative to the policy file
    assert p.auth.admin_key_file == tmp_path / "secret" / "admin.key"
    assert p.queue.priority_header == "x-pacer-priority"
    assert p.engine.kind == EngineKind.SGLANG and p.engine.command == ("python3", "-m", "sglang.launch_server")
    assert dict(p.engine.args) == {"model_path": "/m", "schedule_conservativeness": 1.0, "max_running_requests": 256}
    assert dict(p.engine.env) == {"CUDA_VISIBLE_DEVICES": "0"} and p.engine.base_port == 30000
    assert p.control.mode == ControlMode.ADVISE and p.pacing.queue_band == (50, 500)
    assert "ports 30000..30001" in p.describe() and "API keys from env PACER_API_KEYS" in p.describe()


def test_gpu_sample_interval_is_read() -> None:
    assert parse_policy({}).proxy.gpu_sample_interval_s == 5.0
    assert parse_policy({"proxy": {"gpu_sample_interval_s": 0.5}}).proxy.gpu_sample_interval_s == 0.5
    assert parse_policy({"proxy": {"gpu_sample_interval_s": 0}}).proxy.gpu_sample_interval_s == 0.0  # off


def test_external_workers() -> None:
    p = parse_policy({"engine": {"kind": "external", "urls": ["http://10.0.0.5:30000/"], "speaks": "vllm"}})
    assert p.engine.urls == ("http://10.0.0.5:30000",) and p.engine.workers == 1 and not p.engine.managed
    assert p.engine.engine.name == "vllm" and "external (vllm)" in p.describe()


def test_api_key_is_masked_in_describe() -> None:
    p = parse_policy({"engine": {"args": {"api_key": "sekrit"}}})
    assert "sekrit" not in p.describe()


def test_a_shared_store_is_accepted_and_its_password_masked() -> None:
    assert parse_policy({}).store.url == ""  # the embedded SQLite: nothing to run beside the proxy
    p = parse_policy({"store": {"url": "postgresql://pacer:sekrit@db:5432/pacer"}})
    assert p.store.url == "postgresql://pacer:sekrit@db:5432/pacer"
    assert "sekrit" not in p.describe() and "sekrit" not in "\n".join(p.changed())
    assert "PostgreSQL at db:5432/pacer" in p.describe()


def test_the_store_url_from_an_environment_variable_is_read_when_serve_starts() -> None:
    from proxy.policy import with_store_url_from_env

    p = parse_policy({"store": {"url_env": "PACER_STORE_URL"}})
    assert (p.store.url, p.store.url_env) == ("", "PACER_STORE_URL")  # checked offline without it
    assert "$PACER_STORE_URL" in p.describe()
    url = "postgresql://pacer:sekrit@db:5432/pacer"
    assert with_store_url_from_env(p, {"PACER_STORE_URL": url}).store.url == url
    with pytest.raises(PolicyError, match="not set"):
        with_store_url_from_env(p, {})
    with pytest.raises(PolicyError, match="postgresql"):
        with_store_url_from_env(p, {"PACER_STORE_URL": "mysql://db/p"})
    assert with_store_url_from_env(parse_policy({}), {}).store.url == ""


def _engine(**kw: object) -> dict[str, object]:
    return {"engine": kw}


BAD = [
    ({"proxi": {}}, "proxi", "did you mean 'proxy'"),
    ({"proxy": {"port": 70000}}, "proxy.port", "<= 65535"),
    ({"proxy": {"port": "8000"}}, "proxy.port", "expected an integer"),
    ({"proxy": {"prot": 1}}, "proxy.prot", "did you mean 'port'"),
    ({"proxy": {"max_body_bytes": 0}}, "proxy.max_body_bytes", ">= 1"),
    ({"proxy": {"request_timeout_s": 0}}, "proxy.request_timeout_s", "> 0"),
    ({"proxy": {"gpu_sample_interval_s": -1}}, "proxy.gpu_sample_interval_s", ">= 0"),
    ({"proxy": {"gpu_sample_interval_s": "5"}}, "proxy.gpu_sample_interval_s", "expected a number"),
    ({"proxy": []}, "proxy", "expected a table"),
    ({"auth": {"api_keys_env": 3}}, "auth.api_keys_env", "expected a string"),
    ({"queue": {"capacity": -1}}, "queue.capacity", ">= 0"),
    ({"queue": {"timeout_s": True}}, "queue.timeout_s", "expected a number"),
    ({"queue": {"default_priority": "urgent"}}, "queue.default_priority", "interactive, batch"),
    (_engine(kind="tgi"), "engine.kind", "sim, sglang, vllm, external"),
    (_engine(workers=0), "engine.workers", ">= 1"),
    (_engine(base_port=-1), "engine.base_port", ">= 0"),
    (_engine(base_port=65535, workers=2), "engine.base_port", "past 65535"),
    (
        _engine(args={"max_runing_requests": 8}),
        "engine.args.max_runing_requests",
        "did you mean 'max_running_requests'",
    ),
    (_engine(args={"cuda_graph_max_bs": 64}), "engine.args.cuda_graph_max_bs", "cuda_graph_max_bs_decode"),
    (_engine(args={"schedule_conservativeness": "low"}), "engine.args.schedule_conservativeness", "expected a number"),
    (_engine(args={"port": 1}), "engine.args.port", "engine.base_port"),
    (_engine(kind="sglang", args={"tp_size": 1}), "engine.args.model_path", "required"),
    (_engine(kind="sglang", args={"model_path": "/m", "sim_time_scale": 2}), "engine.args.sim_time_scale", "unknown"),
    (_engine(args=[1]), "engine.args", "expected a table"),
    (_engine(extra_args="--x"), "engine.extra_args", "array of strings"),
    (_engine(extra_args=["--port", "1"]), "engine.extra_args", "--port"),
    (_engine(workers=2, worker_args=[{}, {}, {}]), "engine.worker_args", "3 tables for 2 workers"),
    (
        _engine(workers=2, worker_args={"w1": {}}),
        "engine.worker_args",
        "array of tables, one per worker, e.g. [{}, {mem_fraction_static = 0.8}]",
    ),
    (_engine(kind="vllm", worker_args={"w1": {}}), "engine.worker_args", "e.g. [{}, {gpu_memory_utilization = 0.8}]"),
    (
        _engine(workers=2, worker_args=[{}, {"mem_fracton_static": 0.6}]),
        "engine.worker_args[1].mem_fracton_static",
        "did you mean 'mem_fraction_static'",
    ),
    (_engine(kind="external", urls=["http://a:1"], worker_args=[{}]), "engine.worker_args", "not used"),
    (_engine(command=[]), "engine.command", "must not be empty"),
    (_engine(env={"N": 1}), "engine.env.N", "quote it"),
    (_engine(urls=["http://x:1"]), "engine.urls", 'only for kind = "external"'),
    (_engine(kind="external"), "engine.urls", "at least one URL"),
    (_engine(kind="external", urls=["10.0.0.5:30000"]), "engine.urls[0]", "http(s)://"),
    (_engine(kind="external", urls=["http://a:1"], speaks="tgi"), "engine.speaks", "sglang, vllm"),
    (_engine(kind="external", urls=["http://a:1"], args={"tp_size": 2}), "engine.args", "not used"),
    (_engine(kind="external", urls=["http://a:1"], workers=3), "engine.workers", "one worker per URL"),
    (_engine(startup_timeout_s=-5), "engine.startup_timeout_s", "> 0"),
    (_engine(modle="x"), "engine.modle", "unknown key"),
    ({"pacing": {"queue_band": [2000, 100]}}, "pacing.queue_band", "low must be <= high"),
    ({"pacing": {"queue_band": [-1, 100]}}, "pacing.queue_band", ">= 0"),
    ({"pacing": {"queue_band": [1, 2, 3]}}, "pacing.queue_band", "[low, high]"),
    ({"pacing": {"queue_band": 100}}, "pacing.queue_band", "[low, high]"),
    ({"pacing": {"headroom": -1}}, "pacing.headroom", ">= 0"),
    ({"pacing": {"max_attempts": 0}}, "pacing.max_attempts", ">= 1"),
    ({"pacing": {"stale_after_s": 0.1}}, "pacing.stale_after_s", ">= scrape_interval_s"),
    ({"control": {"mode": "on"}}, "control.mode", "auto, advise, off"),
    ({"control": {"mode": "off", "min_restart_interval_s": 60}}, "control.min_restart_interval_s", "unknown key"),
    ({"store": {"url": "mysql://db/pacer"}}, "store.url", 'a "postgresql://..." URL'),
    ({"store": {"url": "sqlite:///b.db"}}, "store.url", "leave store.url empty"),
    ({"store": {"url": "postgresql://db/p", "url_env": "U"}}, "store.url_env", "not both"),
]


@pytest.mark.parametrize(("doc", "key", "words"), BAD, ids=[case[1] + ":" + case[2] for case in BAD])
def test_bad_values_name_the_key(doc: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(doc, "bad.toml")
    err = info.value
    assert err.key == key
    assert str(err).startswith(f"bad.toml: {key}: ")
    assert words in err.problem


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no such file"):
        load_policy(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[proxy\nport = 1\n")
    with pytest.raises(PolicyError, match="invalid TOML") as info:
        load_policy(broken)
    assert str(broken) in str(info.value)


def test_policies_are_frozen() -> None:
    p = parse_policy({})
    with pytest.raises(AttributeError):
        p.proxy.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.engine.args["x"] = 1  # type: ignore[index]


def test_toml_round_trip_of_the_shipped_default_matches_parse() -> None:
    path = Path(__file__).parents[1] / "policies" / "default.toml"
    assert load_policy(path) == parse_policy(tomllib.loads(path.read_text()), str(path), base_dir=path.parent)


def test_admission_keys_are_read_per_name_and_checked():
    from proxy.policy import KeySettings

    p = parse_policy(
        {"admission": {"batch_floor_share": 0.1, "keys": {"alice": {"weight": 2, "tokens_per_minute": 9}}}}
    )
    assert p.admission.batch_floor_share == 0.1
    assert p.admission.keys == {"alice": KeySettings(weight=2.0, tokens_per_minute=9)}
    with pytest.raises(PolicyError, match=r"admission\.keys\.alice\.wieght"):
        parse_policy({"admission": {"keys": {"alice": {"wieght": 2}}}})
    with pytest.raises(PolicyError, match=r"admission\.batch_floor_share"):
        parse_policy({"admission": {"batch_floor_share": 1.5}})


def test_worker_args_start_one_worker_with_its_own_flags_over_the_pools() -> None:
    p = parse_policy(_engine(workers=3, args={"schedule_conservativeness": 0.5},
                             worker_args=[{}, {"mem_fraction_static": 0.6}]))  # fmt: skip
    assert [dict(a) for a in p.engine.worker_args] == [{}, {"mem_fraction_static": 0.6}]
    assert "worker 1 args mem_fraction_static=0.6 (over args)" in p.describe()


def test_a_retired_key_is_refused_naming_what_replaced_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import MappingProxyType

    from proxy import policy_retired

    monkeypatch.setattr(policy_retired, "RETIRED_KEYS", MappingProxyType({"proxy.old_knob": "derived from the worker"}))
    with pytest.raises(PolicyError, match=r"proxy\.old_knob: this key was removed: derived from the worker"):
        parse_policy({"proxy": {"old_knob": 1}})


@pytest.mark.parametrize(
    ("key", "replaced_by"),
    [
        ("batch_queue_beside_interactive", "beside interactive work the batch keeps one request waiting"),
        ("batch_in_flight_beside_interactive", "derived from the worker: its running-request limit"),
        ("interactive_slot_headroom", "a constant: 1.25 running slots"),
        ("batch_prefill_tokens_beside_interactive", "derived from the worker: two prompt tokens per engine step"),
        ("interactive_window_s", "a constant: 5 s of the engine's clock"),
    ],
)
def test_a_policy_naming_a_retired_pacing_key_is_refused(key: str, replaced_by: str) -> None:
    """The interactive protection's [pacing] keys went: its numbers come from the worker and its clock."""
    with pytest.raises(PolicyError, match=rf"pacing\.{key}: this key was removed: {replaced_by}"):
        parse_policy({"pacing": {key: 1}})


STORE_TIMING = [
    ("claim_s", "a constant: a batch line's claim lasts 14 s"),
    ("poll_s", "constants: a replica looks at the store every second"),
    ("leader_lease_s", "a constant: the leader's lease lasts 10 s"),
]


@pytest.mark.parametrize(("key", "replaced_by"), STORE_TIMING)
def test_a_policy_naming_a_retired_store_timing_is_refused(key: str, replaced_by: str) -> None:
    """The store's timings are constants of the modules that run them: no policy sets them."""
    with pytest.raises(PolicyError, match=rf"store\.{key}: this key was removed: {replaced_by}"):
        parse_policy({"store": {"url": "postgresql://db/p", key: 1}})


@pytest.mark.parametrize("command", ["check-policy", "serve"])
@pytest.mark.parametrize(("key", "replaced_by"), STORE_TIMING)
def test_check_policy_and_serve_refuse_a_retired_store_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, key: str, replaced_by: str
) -> None:
    from proxy.cli import main

    policy = tmp_path / "policy.toml"
    policy.write_text(f'[store]\nurl = "postgresql://db/p"\n{key} = 2\n')
    argv = [command, str(policy)] if command == "check-policy" else [command, "--policy", str(policy)]
    assert main(argv) == 2
    assert f"store.{key}: this key was removed: {replaced_by}" in capsys.readouterr().err
