"""Pure pieces of the front door: key files and request checks."""

from __future__ import annotations

import re

import pytest

from proxy.cli import main
from proxy.errors import ApiError
from proxy.policy import AuthSettings
from proxy.request.admission import Priority
from proxy.server.auth import (
    AuthConfigError,
    Caller,
    KeyRing,
    check_admin_key,
    check_api_key,
    load_keyring,
    parse_entries,
)
from proxy.server.validation import validate_chat, validate_completions, validate_generate


def test_key_entries_both_spellings():
    assert parse_entries("a, b:batch\nc interactive # note\n\n# comment", "x") == {
        "a": Caller("key-1"),
        "b": Caller("key-2", Priority.BATCH),
        "c": Caller("key-3", Priority.INTERACTIVE),
    }
    assert parse_entries("url:with:colons", "x") == {"url:with:colons": Caller("key-1")}
    # the documented KEY:CLASS with a name: the key is the key, not "KEY:batch"
    assert parse_entries("sk-c:batch name=etl, sk-d name=ops", "x") == {
        "sk-c": Caller("etl", Priority.BATCH),
        "sk-d": Caller("ops"),
    }
    with pytest.raises(AuthConfigError, match="class 'gold'"):
        parse_entries("k gold", "keys.txt")


def test_key_entries_carry_names_and_never_expose_the_secret():
    entries = parse_entries("sk-1 name=alice, sk-2 batch name=etl\nsk-3:batch", "x")
    assert entries == {
        "sk-1": Caller("alice"),
        "sk-2": Caller("etl", Priority.BATCH),
        "sk-3": Caller("key-3", Priority.BATCH),
    }
    ring = KeyRing(keys=entries)
    assert ring.names() == ["alice", "etl", "key-3"]
    assert check_api_key(ring, {"x-api-key": "sk-2"}) == Caller("etl", Priority.BATCH)
    with pytest.raises(ApiError, match="incorrect API key"):
        check_api_key(ring, {"Authorization": "Bearer sk-"})  # a prefix of a real key is no key
    with pytest.raises(AuthConfigError, match="empty name"):
        parse_entries("k name=", "keys.txt")


def test_keyring_from_env_and_files(tmp_path):
    f = tmp_path / "keys"
    f.write_text("fk batch\n")
    ring = load_keyring(AuthSettings(api_keys_env="E", api_keys_file=f, admin_key_env="A"), {"E": "ek", "A": "adm"})
    assert ring.keys == {"ek": Caller("key-1"), "fk": Caller("key-2", Priority.BATCH)} and ring.admin_keys == {"adm"}
    assert check_api_key(ring, {"Authorization": "Bearer fk"}).cls is Priority.BATCH
    with pytest.raises(ApiError) as e:
        check_api_key(ring, {"Authorization": "Basic fk"})
    assert e.value.status == 401
    with pytest.raises(ApiError):
        check_admin_key(ring, {"Authorization": "Bearer ek"})
    check_admin_key(ring, {"Authorization": "Bearer adm"})
    with pytest.raises(AuthConfigError, match="cannot read key file"):
        load_keyring(AuthSettings(api_keys_file=tmp_path / "missing"), {})
    assert load_keyring(AuthSettings(), {}).open


def test_a_named_key_source_that_gives_none_is_refused_not_run_open(tmp_path, monkeypatch, capsys):
    """The policy asks for keys from $E (or a file) and there are none: the proxy would run open, every
    route and the admin API with it. serve refuses to start, naming the source; check-policy, which
    may run where the keys are not given, warns."""
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n")
    for auth, env, named in [
        (AuthSettings(api_keys_env="E"), {}, "API keys from $E"),
        (AuthSettings(api_keys_env="E"), {"E": " "}, "API keys from $E"),
        (AuthSettings(api_keys_file=empty), {}, f"API keys from {empty}"),
        (AuthSettings(api_keys_env="E", admin_key_env="A"), {"E": "k"}, "the admin key from $A"),
    ]:
        with pytest.raises(AuthConfigError, match=re.escape(named)) as refused:
            load_keyring(auth, env)
        assert "to run open on purpose" in str(refused.value)
        assert load_keyring(auth, env, refuse_unkeyed=False).open or "admin" in named
    # one named source that gives keys is enough: the proxy does not run open
    assert not load_keyring(AuthSettings(api_keys_env="E", api_keys_file=empty), {"E": "k"}).open
    assert load_keyring(AuthSettings(), {}).open  # nothing named: open, as configured

    policy = tmp_path / "p.toml"
    policy.write_text(
        '[engine]\nkind = "external"\nurls = ["http://127.0.0.1:9"]\n[auth]\napi_keys_env = "PACER_T_KEYS"\n'
    )
    monkeypatch.delenv("PACER_T_KEYS", raising=False)
    assert main(["serve", "--policy", str(policy)]) == 2
    assert "API keys from $PACER_T_KEYS, which gave none" in capsys.readouterr().err
    assert main(["check-policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "warning  here the policy takes API keys from $PACER_T_KEYS" in out and "runs open" not in out


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "model": 3}', "model"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', "max_completion_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": "abc"}',
            "stream_options",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
    ],
)
def test_chat_checks_name_the_field(raw, param):
    with pytest.raises(ApiError) as e:
        validate_chat(raw)
    assert e.value.status == 400 and e.value.param == param and param.split("[")[0] in e.value.message


def test_jobs_describe_what_to_forward():
    job = validate_chat(b'{"messages": [{"role": "user", "content": "hello"}], "stream": true}')
    assert job.stream and job.single and job.affinity == "hello" and job.model is None
    job = validate_completions(b'{"prompt": ["a", "b"], "model": "m"}')
    assert not job.single and job.model == "m"
    job = validate_completions(b'{"prompt": [1, 2, 3]}')
    assert job.single and job.affinity is None
    job = validate_chat(
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 5}'
    )
    assert (
        job.max_tokens == 5
    )  # max_completion_tokens wins, as SGLang and vLLM read the two (the facts and budgets too)
    with pytest.raises(ApiError):
        validate_completions(b'{"prompt": [1, "a"]}')
    job = validate_generate(b'{"text": "t", "sampling_params": {"max_new_tokens": 3}}')
    assert job.single and job.path == "/generate"
    assert not validate_generate(b'{"text": ["a", "b"]}').single
    with pytest.raises(ApiError, match=r"sampling_params\.max_new_tokens"):
        validate_generate(b'{"text": "t", "sampling_params": {"max_new_tokens": "x"}}')
    # a batch of prompts, each with its own sampling_params (SGLang's GenerateReqInput takes a list)
    batch = validate_generate(
        b'{"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 300}]}'
    )
    assert not batch.single and batch.max_tokens == 300
    with pytest.raises(ApiError, match=r"sampling_params\[1\]\.max_new_tokens"):
        validate_generate(b'{"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": -1}]}')
    with pytest.raises(ApiError, match="an array of objects"):
        validate_generate(b'{"text": ["a"], "sampling_params": [3]}')
    # n > 1: SGLang runs the prompt as a batch, its rid a list: the proxy names no attempt of it
    parallel = validate_generate(b'{"text": "t", "sampling_params": {"n": 2, "max_new_tokens": 5}}')
    assert not parallel.single and parallel.choices == 2
    with pytest.raises(ApiError, match="empty"):
        validate_chat(b"")
