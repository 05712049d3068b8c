"""``python -m loadtests NAME [options]``: one module per benchmark, each with ``main(argv) -> int``.

sim        the simulated engine is not the bottleneck (modelled vs sustained token rate)
overhead   direct vs through sglang-pacer vs through sglang-router
scenario   controller scenarios: default vs adaptive vs oracle arms
fleet      two pools behind one proxy vs behind separate proxies (per-pool throughput)
batch      a Batch API job through the proxy vs the best constant concurrency straight to the worker
store      the Batch API store's cost per line: SQLite vs a shared PostgreSQL
limits     per-key limits across replicas: in memory vs shared over PostgreSQL (added TTFT, limit held)
budget     the output budget on vs off vs control off: first tokens, tails, throughput
failover   three replicas on one PostgreSQL: pacing alone vs by share, the leader killed under load
reshape    a pool of 8 simulated GPUs at tp 8 reshaped by the controller vs the best shape in hindsight
phase-noise  a phased scenario's per-phase oracle: how much of its gain is the workload's, how much the sample's
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

BENCHMARKS: dict[str, str] = {
    "sim": "loadtests.sim_speed",
    "overhead": "loadtests.overhead",
    "scenario": "loadtests.scenarios",
    "batch": "loadtests.batch_job",
    "fleet": "loadtests.fleet",
    "store": "loadtests.store_overhead",
    "limits": "loadtests.key_limits",
    "budget": "loadtests.budget",
    "failover": "loadtests.failover",
    "reshape": "loadtests.reshape",
    "phase-noise": "loadtests.phase_noise",
}


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM ends a benchmark as Ctrl-C does: its cleanup stops the proxies and engines it started."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _exit_on_term)
    if not argv or argv[0] not in BENCHMARKS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
