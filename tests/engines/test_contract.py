"""The engine contract: each registered engine implements it in full, and the registry and the
policy's vocabulary agree."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from proxy.engines.base import EventKind, KnobName, Modelled
from proxy.engines.contract import Engine, is_restart_needed
from proxy.engines.registry import ENGINES, SPOKEN_BY_DEFAULT, EngineKind, engine_named, example_arg

FIXTURES = Path(__file__).parent / "fixtures"

CONTRACT = {name for name, _ in inspect.getmembers(Engine) if not name.startswith("_")}


def test_the_registry_holds_each_managed_kind() -> None:
    assert set(ENGINES) == {k.value for k in EngineKind} - {EngineKind.EXTERNAL}
    assert all(engine.name == name for name, engine in ENGINES.items())
    with pytest.raises(ValueError, match="unknown engine 'tgi'; expected one of sim, sglang, vllm"):
        engine_named("tgi")


def test_the_policy_s_examples_name_each_engine_s_own_argument() -> None:
    assert example_arg(KnobName.MEMORY_FRACTION) == "mem_fraction_static"  # the default kind's: the simulator's
    assert example_arg(KnobName.MAX_RUNNING, EngineKind.VLLM) == "max_num_seqs"
    assert example_arg(KnobName.CONSERVATIVENESS, EngineKind.VLLM) == "schedule_conservativeness"  # vLLM has none
    assert example_arg(KnobName.MEMORY_FRACTION, EngineKind.EXTERNAL) == "mem_fraction_static"
    assert SPOKEN_BY_DEFAULT in ENGINES


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_has_every_member_of_the_contract(name: str) -> None:
    engine = ENGINES[name]
    assert set(dir(engine)) >= CONTRACT, CONTRACT - set(dir(engine))
    assert isinstance(engine.ready_marker, str) and engine.ready_marker
    assert engine.default_command()
    argv = engine.build_argv({}, [], host="127.0.0.1", port=8001)
    assert argv[argv.index("--port") + 1] == "8001"
    assert engine.check_arg("no_such_flag_anywhere", 1) is not None


@pytest.mark.parametrize("name", list(ENGINES))
def test_no_knob_the_controller_moves_changes_without_a_restart(name: str) -> None:
    """SGLang's /set_internal_state allow-list and vLLM's fixed scheduler config (see the engine modules)."""
    engine = ENGINES[name]
    assert all(is_restart_needed(engine, knob) for knob in engine.knobs)


def test_the_simulator_speaks_sglang_and_takes_its_own_args() -> None:
    sim, sglang = ENGINES["sim"], ENGINES["sglang"]
    assert sim.check_arg("sim_gpu", "h100-80gb") is None
    assert sglang.check_arg("sim_gpu", "h100-80gb") is not None
    assert sim.required_args() == () and sglang.required_args() == ("model_path",)
    assert sim.ready_marker == sglang.ready_marker and sim.knobs is sglang.knobs
    assert sim.default_command()[-2:] == ["proxy", "sim"]


def test_the_presets_a_simulated_worker_models_are_the_ones_its_args_or_extra_args_name() -> None:
    """The twin of a simulated worker is its own GPU and model presets, however the policy names
    them; a real engine models nothing (NVML says what its GPU is)."""
    sim = ENGINES["sim"]
    assert sim.modelled({"sim_gpu": "l40s-48gb"}, ()).gpu == "l40s-48gb"
    assert sim.modelled({}, ["--sim-time-scale", "10", "--sim-gpu", "a100-40gb"]).gpu == "a100-40gb"
    assert sim.modelled({}, ["--sim-gpu=rtx4090-24gb"]).gpu == "rtx4090-24gb"
    # both: the extra arguments come last on the command line, and the simulator runs the last
    assert sim.modelled({"sim_gpu": "l40s-48gb"}, ["--sim-gpu", "a100-40gb"]).gpu == "a100-40gb"
    # no GPU or model named: the twin's presets are not the worker's to say; its clock is
    assert sim.modelled({}, ["--sim-time-scale", "10"]) == Modelled(clock_rate=10.0)
    assert sim.modelled({"sim_model": "qwen2.5-7b"}, ["--sim-model", "llama-3.2-1b"]) == Modelled(model="llama-3.2-1b")
    assert sim.modelled({"sim_model": "qwen2.5-7b", "sim_gpu": "a100-40gb"}, ()) == Modelled(
        gpu="a100-40gb", model="qwen2.5-7b"
    )
    for name in ("sglang", "vllm"):
        assert ENGINES[name].modelled({"sim_gpu": "l40s-48gb"}, ["--sim-gpu", "a100-40gb"]) == Modelled()


def test_prefix_affinity_follows_the_engines_own_scheduler() -> None:
    assert ENGINES["sglang"].prefix_affinity({"schedule_policy": "lpm"})
    assert not ENGINES["sglang"].prefix_affinity({"schedule_policy": "fcfs"})
    assert not ENGINES["sglang"].prefix_affinity({})
    assert not ENGINES["vllm"].prefix_affinity({"schedule_policy": "lpm"})


def test_the_prefix_queue_limit_is_sglang_s_lpm_limit_and_vllm_has_none() -> None:
    """SGLang's lpm stops matching prefixes past 128 waiting (SchedulePolicy._determine_active_policy);
    the simulated scheduler keeps the same limit."""
    from proxy.sim.scheduler import LPM_QUEUE_LIMIT

    assert ENGINES["sglang"].prefix_queue_limit({"schedule_policy": "lpm"}) == 128 == LPM_QUEUE_LIMIT
    assert ENGINES["sim"].prefix_queue_limit({"schedule_policy": "lpm"}) == 128
    assert ENGINES["sglang"].prefix_queue_limit({"schedule_policy": "fcfs"}) is None
    assert ENGINES["sglang"].prefix_queue_limit({}) is None  # SGLang's default is fcfs
    assert ENGINES["vllm"].prefix_queue_limit({"schedule_policy": "lpm"}) is None


def test_loads_and_server_info_only_where_the_engine_has_them() -> None:
    assert ENGINES["sglang"].loads_path == "/v1/loads" and ENGINES["sglang"].server_info_path == "/server_info"
    assert ENGINES["vllm"].loads_path is None and ENGINES["vllm"].server_info_path is None
    with pytest.raises(NotImplementedError):
        ENGINES["vllm"].parse_loads({}, 0.0)


@pytest.mark.parametrize(
    ("name", "log", "cause", "phase"),
    [
        ("sglang", "sglang_crash_prefill_allocator.log", "oom", "prefill"),
        ("sglang", "sglang_crash_decode_cuda_oom.log", "oom", "decode"),
        ("sglang", "sglang_crash_value_error.log", "crash", "unknown"),
        ("vllm", "vllm_0.32_cpu_kv_capacity_error.log", "kv_capacity", "unknown"),
    ],
)
def test_classify_death_reads_the_log_tail(name: str, log: str, cause: str, phase: str) -> None:
    death = ENGINES[name].classify_death((FIXTURES / log).read_text().splitlines())
    assert (death.cause, death.phase) == (cause, phase)


def test_a_log_that_says_nothing_is_an_unknown_death() -> None:
    for engine in ENGINES.values():
        death = engine.classify_death(["some line", "the last line"])
        assert death.cause == "unknown" and death.detail == "the last line"
        assert engine.log_reader().feed("the last line", 0.0) == []
        assert EventKind.OOM not in {e.kind for e in engine.log_reader().flush(0.0)}
    assert KnobName.CONSERVATIVENESS in ENGINES["sglang"].knobs


def test_placement_flags_come_from_each_engines_own_table() -> None:
    from proxy.engines.registry import ENGINES

    assert ENGINES["sglang"].placement_args(4, "m") == {"tp_size": 4, "served_model_name": "m"}
    assert ENGINES["vllm"].placement_args(2, None) == {"tensor_parallel_size": 2}
    for engine in ENGINES.values():
        for name, value in engine.placement_args(8, "some/model").items():
            assert engine.check_arg(name, value) is None, (engine.name, name)


@pytest.mark.parametrize("name", list(ENGINES))
def test_extra_args_may_not_set_what_the_supervisor_sets(name: str) -> None:
    engine = ENGINES[name]
    for extra in (["--port", "9000"], ["--port=9000"]):
        assert engine.check_extra_args(extra) == "--port is set by the supervisor (use engine.host / engine.base_port)"
    assert engine.check_extra_args(["--host", "0.0.0.0"]) is not None
    assert engine.check_extra_args(["--portable", "--hostile=1"]) is None


@pytest.mark.parametrize(
    ("name", "admin_key_shown"), [("sim", "--admin-api-key=***"), ("sglang", "--admin-api-key=***"), ("vllm", None)]
)
def test_a_logged_command_line_shows_no_api_key(name: str, admin_key_shown: str | None) -> None:
    """SGLang takes ``--api-key`` and ``--admin-api-key``; vLLM only ``--api-key`` (no admin key flag)."""
    argv = ["--model-path", "m", "--api-key", "k1", "--admin-api-key=k2", "--port", "8001", "--api-key"]
    shown = ENGINES[name].masked_argv(argv)
    admin = admin_key_shown or "--admin-api-key=k2"
    assert shown == ["--model-path", "m", "--api-key", "***", admin, "--port", "8001", "--api-key"]
    assert argv[3] == "k1"  # the command line itself is left as it is
    assert ENGINES[name].secret_args == ({"api_key"} if admin_key_shown is None else {"api_key", "admin_api_key"})
    assert "served_model_name" in ENGINES[name].model_args  # a trial may not change which model it serves


def test_priority_fields_only_when_the_worker_orders_by_priority() -> None:
    """SGLang (and the simulator): higher values first unless low values first; vLLM: lower first.
    Without the worker's flag nothing is added (SGLang ignores or refuses it, vLLM refuses it)."""
    for name in ("sglang", "sim"):
        engine = ENGINES[name]
        assert engine.priority_fields({}, interactive=True) == {}
        assert engine.priority_fields({"enable_priority_scheduling": False}, interactive=False) == {}
        on = {"enable_priority_scheduling": True}
        hi, lo = engine.priority_fields(on, interactive=True), engine.priority_fields(on, interactive=False)
        assert hi["priority"] - lo["priority"] > 10  # above the default preemption threshold
        on_low = {**on, "schedule_low_priority_values_first": True}
        hi, lo = engine.priority_fields(on_low, interactive=True), engine.priority_fields(on_low, interactive=False)
        assert lo["priority"] - hi["priority"] > 10
    vllm = ENGINES["vllm"]
    assert vllm.priority_fields({"scheduling_policy": "fcfs"}, interactive=True) == {}
    on = {"scheduling_policy": "priority"}
    assert (
        vllm.priority_fields(on, interactive=True)["priority"] < vllm.priority_fields(on, interactive=False)["priority"]
    )


@pytest.mark.parametrize("low_first", [False, True])
def test_the_simulated_scheduler_admits_the_interactive_field_first(low_first: bool) -> None:
    """What the engine module sends, as the simulator's (SGLang's) queue order reads it."""
    from proxy.sim.request import State
    from tests.sim.helpers import engine as sim_engine
    from tests.sim.helpers import run_until, unique_prompt

    flags = ["--enable-priority-scheduling", "--max-running-requests", "1", "--disable-priority-preemption"]
    args: dict[str, object] = {"enable_priority_scheduling": True}
    if low_first:
        flags.append("--schedule-low-priority-values-first")
        args["schedule_low_priority_values_first"] = True
    eng = sim_engine(*flags)
    fields = {c: ENGINES["sim"].priority_fields(args, interactive=c) for c in (True, False)}

    def add(i: int, interactive: bool):  # type: ignore[no-untyped-def]
        return eng.add(prompt_ids=unique_prompt(20, i), max_new_tokens=8, **fields[interactive])

    first = add(0, False)
    run_until(eng, lambda: first.state is State.RUNNING)
    batch, inter = add(1, False), add(2, True)
    run_until(eng, lambda: inter.state is not State.WAITING)
    assert batch.state is State.WAITING


def test_sglang_aborts_a_request_by_its_rid_and_vllm_only_by_closing_its_connection() -> None:
    for name in ("sglang", "sim"):
        by_name = ENGINES[name].abort_by_name
        assert by_name is not None and by_name.answers_with_output
        assert (by_name.field, by_name.path, by_name.body("pacer-1.2")) == (
            "rid",
            "/abort_request",
            {"rid": "pacer-1.2"},
        )
    assert ENGINES["vllm"].abort_by_name is None


def test_only_the_simulator_places_its_workers_on_modelled_gpus() -> None:
    assert [(name, ENGINES[name].uses_host_gpus) for name in ("sim", "sglang", "vllm")] == [
        ("sim", False),
        ("sglang", True),
        ("vllm", True),
    ]


def test_the_running_limit_comes_from_sglang_s_server_info_and_vllm_has_none() -> None:
    """SGLang: the schedulers' own figure, each DP rank's summed; else the resolved arg; vLLM: no server info."""
    sglang, vllm = ENGINES["sglang"], ENGINES["vllm"]
    per_dp = {"max_running_requests": None, "internal_states": [{"effective_max_running_requests_per_dp": 48}] * 2}
    assert sglang.running_limit(per_dp) == 96
    assert sglang.running_limit({"max_running_requests": 256, "internal_states": [{}]}) == 256
    assert sglang.running_limit({"max_running_requests": None}) is None
    assert sglang.running_limit({"max_running_requests": True}) is None
    assert ENGINES["sim"].running_limit({"max_running_requests": 8}) == 8
    assert vllm.running_limit({"max_num_seqs": 256}) is None


def test_a_worker_s_launch_arguments_give_its_running_limit_where_they_name_it() -> None:
    """Before (and without) its server info: vLLM's ``max_num_seqs``, SGLang's ``max_running_requests``."""
    from proxy.compose import _launched_running_limit
    from proxy.workers.base import WorkerInfo, WorkerState

    def info(**args: object) -> WorkerInfo:
        return WorkerInfo(id="w0", url="http://w0", state=WorkerState.READY, managed=True, args=args)

    assert _launched_running_limit(ENGINES["vllm"], info(max_num_seqs=64)) == 64
    assert _launched_running_limit(ENGINES["sglang"], info(max_running_requests=32)) == 32
    assert _launched_running_limit(ENGINES["sglang"], info(max_num_seqs=64)) is None  # not SGLang's name
    assert _launched_running_limit(ENGINES["vllm"], info()) is None  # left to the engine: its default


def test_the_planner_s_twin_reads_an_sglang_worker_s_arguments_under_its_own_presets() -> None:
    """The twin is an SGLang model: a simulated or real SGLang worker's arguments, less the hidden
    factors of a simulated one and the unset; a vLLM worker is not its to model."""
    args = {"schedule_conservativeness": 1, "sim_step_time_factor": 3.0, "max_running_requests": None, "tp_size": 2}
    for name in ("sim", "sglang"):
        own = ENGINES[name].twin_args(args)
        assert own == {"schedule_conservativeness": 1.0, "tp_size": 2}
        assert isinstance(own["schedule_conservativeness"], float)
    assert ENGINES["vllm"].twin_args({"max_num_seqs": 64}) is None
