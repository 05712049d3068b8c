"""``pacer sim [SGLang flags] [--sim-* flags]``: the simulated SGLang server.

SGLang's own flag names (one argv starts either this or ``python -m sglang.launch_server``). Flags
SGLang knows that change nothing here (``--log-level``, ``--trust-remote-code``...) are accepted
and ignored; unknown flags are an error, as in SGLang. Simulator-only flags start with ``--sim-``.

Exit codes: 0 after SIGTERM/SIGINT, 1 when the server dies (out of memory, start-up failure),
2 for a bad command line.
"""

from __future__ import annotations

import argparse
import sys

from proxy.engines.sglang.argv import KNOWN_FLAGS, SCHEDULE_POLICIES
from proxy.sim.config import SimConfig, SimConfigError, resolve_config
from proxy.sim.presets import GPUS, MODELS

__all__ = ["SimConfig", "build_parser", "main", "resolve_config"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pacer sim", description="Simulated SGLang server (no GPU).")
    _add_modelled_flags(p)
    _add_simulator_flags(p)
    _add_ignored_flags(p)
    return p


def _add_modelled_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's flags that change what the simulator does, under SGLang's names and defaults."""
    a = p.add_argument
    a("--model-path", "--model", dest="model_path", default=None, help="free text; the preset is --sim-model")
    a("--served-model-name", default=None)
    a("--tokenizer-path", default=None)
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000, help="0 picks a free port (printed in the Uvicorn line)")
    a("--api-key", default=None)
    a("--schedule-conservativeness", type=float, default=1.0)
    a(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default="fcfs",
        help="fcfs, lpm, lof and random are modelled; the others schedule as fcfs",
    )
    a("--enable-priority-scheduling", action="store_true", help="order the waiting queue by each request's priority")
    a("--schedule-low-priority-values-first", action="store_true", help="lower priority values first (default higher)")
    a("--priority-scheduling-preemption-threshold", type=int, default=10)
    a("--disable-priority-preemption", action="store_true")
    a("--max-running-requests", type=int, default=None)
    a("--max-queued-requests", type=int, default=None)
    a("--chunked-prefill-size", type=int, default=None, help="-1 disables chunked prefill")
    a("--max-prefill-tokens", type=int, default=16384)
    a("--mem-fraction-static", type=float, default=None)
    a("--max-total-tokens", type=int, default=None)
    a("--context-length", type=int, default=None)
    a("--enable-metrics", action="store_true")
    a("--enable-cache-report", action="store_true")
    a("--decode-log-interval", type=int, default=40)
    a("--cuda-graph-max-bs-decode", type=int, default=None)
    a("--cuda-graph-max-bs-prefill", type=int, default=None)
    a("--cuda-graph-backend-decode", choices=("full", "breakable", "disabled"), default=None)
    a("--disable-cuda-graph", action="store_true", help="deprecated in SGLang 0.5.x; still honoured")
    a("--disable-radix-cache", action="store_true")
    a("--quantization", default=None)
    a("--kv-cache-dtype", default="auto")
    a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    a("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    a("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    a("--page-size", type=int, default=None)
    a("--random-seed", type=int, default=None)
    a("--log-level", default="info")


def _add_simulator_flags(p: argparse.ArgumentParser) -> None:
    """The simulator's own flags (``--sim-*``): the preset, its clock, the outputs, the perturbations."""
    s = p.add_argument_group("simulator")
    s.add_argument("--sim-gpu", default="h100-80gb", choices=sorted(GPUS))
    s.add_argument("--sim-model", default="llama-3.1-8b", choices=sorted(MODELS))
    s.add_argument("--sim-time-scale", type=float, default=1.0, help="10 = ten times faster than the modelled GPU")
    s.add_argument("--sim-seed", type=int, default=None, help="default: --random-seed, else 0")
    s.add_argument(
        "--sim-startup-seconds",
        type=float,
        default=None,
        help="real seconds from launch to ready (default: the modelled start-up / time scale)",
    )
    s.add_argument(
        "--sim-output-fraction",
        type=float,
        default=1.0,
        help="true output length, as a fraction of max_new_tokens (the mean)",
    )
    s.add_argument(
        "--sim-output-spread",
        type=float,
        default=0.0,
        help="half-width of a uniform spread around --sim-output-fraction",
    )
    s.add_argument("--sim-output-cap", type=int, default=None, help="no true output is longer than this")
    s.add_argument(
        "--sim-step-time-factor",
        type=float,
        default=1.0,
        help="every step takes this many times the modelled time (a hidden perturbation of the GPU model)",
    )
    s.add_argument(
        "--sim-activation-factor",
        type=float,
        default=1.0,
        help="every step's activations take this many times the modelled memory (a hidden perturbation)",
    )


def _add_ignored_flags(p: argparse.ArgumentParser) -> None:
    """Every other flag SGLang's parser knows: accepted, no effect on the simulation."""
    a = p.add_argument
    taken = {act.dest for act in p._actions}
    for name, spec in KNOWN_FLAGS.items():
        if name in taken:
            continue
        flag = "--" + name.replace("_", "-")
        if spec.type == "bool":
            a(flag, action="store_true", help=argparse.SUPPRESS)
        elif spec.type == "int_list":
            a(flag, type=int, nargs="+", default=None, help=argparse.SUPPRESS)
        else:
            a(flag, type={"int": int, "float": float}.get(spec.type, str), default=None, help=argparse.SUPPRESS)


def main(argv: list[str]) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    from proxy.sim.logs import LogSink

    sink = LogSink(rank_prefix=" TP0" if (ns.tp_size or 1) > 1 else "")
    try:
        config = resolve_config(ns)
    except SimConfigError as exc:
        sink("error", f"Scheduler hit an exception: Traceback (most recent call last):\nRuntimeError: {exc}")
        sink("error", "Received sigquit from a child process. It usually means the child failed.")
        return 1
    from proxy.sim.server import run_server

    return run_server(config, sink)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
