"""``python -m loadtests sim`` at tiny scale: both parts run and the report carries their figures."""

from __future__ import annotations

import json

from loadtests import sim_speed


def test_sim_speed_benchmark_reports_virtual_and_server_figures(tmp_path):
    report = tmp_path / "sim.json"
    rc = sim_speed.main(
        [
            "--report",
            str(report),
            "--concurrency",
            "16",
            "--max-new-tokens",
            "64",
            "--warmup",
            "0.5",
            "--window",
            "1.5",
            "--time-scale",
            "4",
        ]
    )
    assert rc == 0
    data = json.loads(report.read_text())
    virtual, server = data["virtual"], data["server"]
    assert virtual["output_tokens"] > 0 and virtual["simulated_tok_per_cpu_s"] > 0
    assert server["engine_tokens"] > 0 and server["client_tokens"] > 0
    assert server["modelled_tok_per_s"] > 0 and server["lag"] > 0
