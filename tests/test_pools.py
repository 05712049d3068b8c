"""[[pool]] tables: several pools of workers, each with its model, tp and GPUs; bad placements are
refused with the key named; the [engine] table is the one-pool shorthand."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.observe import nvml
from proxy.policy import PolicyError, load_policy, parse_policy
from tests.observe.test_nvml import _Nvml

POLICIES = Path(__file__).parents[1] / "policies"


def pools(*tables: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"pool": list(tables), **top}


def refused(doc: dict[str, Any]) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse_policy(doc, "<t>")
    return info.value


def test_the_engine_table_is_one_pool_named_default() -> None:
    p = parse_policy({"engine": {"workers": 2}}, "<t>")
    (pool,) = p.pools
    assert pool.name == "default" and pool.engine is p.engine and pool.engine.workers == 2
    assert [pool.worker_id(i) for i in range(2)] == ["w0", "w1"]
    assert pool.gpu_sets() == ((), ())  # no placement: CUDA_VISIBLE_DEVICES as it is


def test_two_pools_with_their_gpus_models_and_control_overrides() -> None:
    p = parse_policy(
        pools(
            {"name": "big", "model": "m70", "tp": 4, "gpus": [0, 1, 2, 3], "control": {"restarts_per_hour": 1}},
            {"name": "small", "model": "m8", "gpus": [4, 5, 6, 7], "args": {"sim_model": "llama-3.1-8b"}},
            control={"mode": "advise", "restarts_per_hour": 5},
        ),
        "<t>",
    )
    big, small = p.pools
    assert (big.engine.workers, small.engine.workers) == (1, 4)  # workers from the GPUs: len(gpus) / tp
    assert big.gpu_sets() == ((0, 1, 2, 3),) and small.gpu_sets() == ((4,), (5,), (6,), (7,))
    assert big.control.restarts_per_hour == 1 and big.control.mode == "advise"  # override + inherited
    assert small.control.restarts_per_hour == 5
    assert big.worker_id(0) == "big-w0" and (big.model, small.model) == ("m70", "m8")
    assert p.placement(8) == {"big": ((0, 1, 2, 3),), "small": ((4,), (5,), (6,), (7,))}


@pytest.mark.parametrize(
    ("doc", "key", "words"),
    [
        (
            pools({"name": "a", "model": "x", "gpus": [0, 1]}, {"name": "b", "model": "y", "gpus": [1]}),
            "pool.b.gpus",
            "GPU 1 is given twice",
        ),
        (pools({"name": "a", "gpus": [0, 0]}), "pool[0].gpus", "GPU 0 is given twice"),
        (pools({"name": "a", "tp": 4, "gpus": [0, 1, 2]}), "pool[0].gpus", "tp = 4 does not divide the 3 GPUs"),
        (pools({"name": "a", "gpus": []}), "pool[0].gpus", "is empty"),
        (
            pools(
                {"name": "a", "model": "x", "gpus": [0, 1], "base_port": 31700},
                {"name": "b", "model": "y", "gpus": [2, 3], "base_port": 31701},
            ),
            "pool.b.base_port",
            "ports 31701..31702 overlap those of pool 'a' (31700..31701)",
        ),
        (pools({"name": "a", "gpus": [0, 1], "workers": 3}), "pool[0].workers", "make 2 workers"),
        (pools({"name": "a", "model": "x"}, {"name": "a", "model": "y"}), "pool[1].name", "also pool[0]"),
        (pools({"name": "a", "model": "x"}, {"name": "b"}), "pool.b.model", "required when there are several"),
        (pools({"name": "a", "model": "x"}, {"name": "b", "model": "x"}), "pool.b.model", "served by pool 'a' too"),
        (pools({"name": "a", "tp": 2, "args": {"tp_size": 2}}), "pool[0].args.tp_size", "set by the pool"),
        (pools({"name": "a", "gpus": "all"}), "pool[0].gpus", 'or "auto"'),
        (pools({"name": "a", "kind": "external", "urls": ["http://h:1"], "gpus": [0]}), "pool[0].gpus", "external"),
        (pools({"name": "a", "tpp": 2}), "pool[0].tpp", "did you mean 'tp'"),
        ({"engine": {}, "pool": [{"name": "a"}]}, "engine", "not both"),
    ],
)
def test_bad_pools_are_refused_naming_the_key(doc: dict[str, Any], key: str, words: str) -> None:
    err = refused(doc)
    assert err.key == key and words in err.problem


def test_pools_on_ports_side_by_side_are_fine_and_on_ray_nodes_may_share_them() -> None:
    doc = pools({"name": "a", "model": "x", "gpus": [0, 1], "base_port": 31700},
                {"name": "b", "model": "y", "gpus": [2, 3], "base_port": 31702})  # fmt: skip
    assert [p.engine.base_port for p in parse_policy(doc, "<t>").pools] == [31700, 31702]
    on_ray = pools({"name": "a", "model": "x", "gpus": "auto", "workers": 2, "base_port": 31700},
                   {"name": "b", "model": "y", "gpus": "auto", "workers": 2, "base_port": 31701},
                   fleet={"backend": "ray"})  # fmt: skip
    assert [p.engine.base_port for p in parse_policy(on_ray, "<t>").pools] == [31700, 31701]


def on_gpus(**table: Any) -> dict[str, Any]:
    """A pool of real SGLang workers (they compute on the host's GPUs)."""
    return {"kind": "sglang", "args": {"model_path": "m"}, **table}


def test_placement_against_the_gpus_nvml_sees() -> None:
    p = parse_policy(
        pools(on_gpus(name="a", model="x", gpus=[0, 9]), on_gpus(name="b", model="y", gpus="auto", workers=2)),
        "<t>",
    )
    with pytest.raises(PolicyError, match=r"pool\.a\.gpus: GPU 9 does not exist: NVML sees 8"):
        p.placement(8)
    with pytest.raises(PolicyError, match=r'pool\.b\.gpus: "auto" needs NVML'):
        p.placement(None)
    explicit = parse_policy(pools(on_gpus(name="a", gpus=[0, 9])), "<t>")
    assert explicit.placement(None) == {"a": ((0,), (9,))}  # no NVML: explicit ids stand as given
    auto = parse_policy(
        pools(on_gpus(name="a", model="x", gpus=[0, 1]), on_gpus(name="b", model="y", tp=2, gpus="auto", workers=2)),
        "<t>",
    )
    assert auto.placement(8)["b"] == ((2, 3), (4, 5))  # the first free ones, tp per worker
    with pytest.raises(PolicyError, match=r'"auto" needs 4 GPUs \(2 workers x tp 2\); 2 of 4 are free'):
        auto.placement(4)


def test_a_simulated_pool_names_modelled_gpus_the_host_may_lack() -> None:
    """The simulator models its GPUs: policies/sim-8gpu-two-models.toml runs on a one-GPU laptop,
    while a real engine's pool beside it is still held to the GPUs NVML sees."""
    sim = load_policy(POLICIES / "sim-8gpu-two-models.toml")
    assert sim.placement(1) == {"llama-70b": ((0, 1, 2, 3),), "llama-8b": ((4,), (5,), (6,), (7,))}
    mixed = parse_policy(
        pools({"name": "s", "model": "x", "gpus": [4, 5]}, on_gpus(name="r", model="y", gpus="auto")),
        "<t>",
    )
    assert mixed.placement(1) == {"s": ((4,), (5,)), "r": ((0,),)}
    real = parse_policy(pools({"name": "s", "model": "x", "gpus": [0]}, on_gpus(name="r", model="y", gpus=[1])), "<t>")
    with pytest.raises(PolicyError, match=r"pool\.r\.gpus: GPU 1 does not exist: NVML sees 1"):
        real.placement(1)


@pytest.mark.parametrize("host_gpus", [0, 8], ids=["no GPU", "the 8-GPU node they are written for"])
def test_the_fleet_policies_pass_check_policy(
    host_gpus: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the host's GPUs as NVML would report them, so the check does not depend on this machine's
    monkeypatch.setattr(nvml, "sample_gpus", lambda: nvml.sample_with(_Nvml(count=host_gpus)))
    for name in ("h100x8-two-models.toml", "sim-8gpu-two-models.toml"):
        assert main(["check-policy", str(POLICIES / name)]) == 0
        out = capsys.readouterr().out
        assert "pool     llama-70b: model meta-llama/Llama-3.1-70B-Instruct, tp 4, GPUs 0 1 2 3" in out
        assert "llama-8b-w3 on GPU 7" in out
        # no GPU here: real engines' ids cannot be checked, and check-policy says so; a simulated pool's are modelled
        unchecked = "the ids given are not checked against the host's GPUs" in out
        assert unchecked is (host_gpus == 0 and name.startswith("h100"))
        p = load_policy(POLICIES / name)
        changed = p.changed()
        assert not any(c.startswith("engine.") for c in changed)
        small = changed.index('name = "llama-8b"')
        assert changed[small - 1] == "[[pool]]" and "workers = 4" in changed[small:]
        assert [(x.name, x.engine.workers, x.tp) for x in p.pools] == [("llama-70b", 1, 4), ("llama-8b", 4, 1)]


def test_check_policy_refuses_a_gpu_given_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (POLICIES / "sim-8gpu-two-models.toml").read_text().replace("gpus = [4, 5, 6, 7]", "gpus = [3, 5, 6, 7]")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    tomllib.loads(text)
    assert main(["check-policy", str(bad)]) == 2
    assert "pool.llama-8b.gpus: GPU 3 is given twice (pool 'llama-70b' has it)" in capsys.readouterr().err
