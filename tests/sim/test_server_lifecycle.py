"""Start-up, auth, the queue limit, crashes and shutdown of the server process."""

from __future__ import annotations

import json
import threading

import openai

from proxy.engines.sglang.logs import classify_death
from tests.harness.wait import wait_until_blocking
from tests.sim.helpers import http, start_sim


def test_health_is_503_while_starting_then_200() -> None:
    sim = start_sim("--sim-time-scale", "10", startup=2.0, wait=False)
    try:
        assert http("GET", sim.url + "/health")[0] == 503
        assert http("GET", sim.url + "/health_generate")[0] == 503
        status, raw = http("POST", sim.url + "/generate", b'{"text": "x"}')
        assert status == 503 and "starting" in json.loads(raw)["error"]["message"]
        sim.wait_ready()
        assert http("GET", sim.url + "/health")[0] == 200
        log = sim.log_text()
        for needle in (
            "Load weight end.",
            "KV Cache is allocated.",
            "Capture cuda graph end.",
            "max_total_num_tokens=",
            "available_gpu_mem=",
        ):
            assert needle in log
        assert log.index("max_total_num_tokens=") < log.index("The server is fired up and ready to roll!")
    finally:
        assert sim.stop() == 0


def test_api_key() -> None:
    sim = start_sim("--api-key", "sekret", "--enable-metrics")
    try:
        status, raw = http("GET", sim.url + "/v1/models")
        assert status == 401 and json.loads(raw) == {"error": "Unauthorized"}
        assert http("GET", sim.url + "/health")[0] == 200
        assert http("GET", sim.url + "/metrics")[0] == 200
        client = openai.OpenAI(base_url=sim.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        sim.stop()


def test_metrics_only_with_enable_metrics_and_queue_limit() -> None:
    sim = start_sim("--max-running-requests", "1", "--max-queued-requests", "1", "--sim-time-scale", "1")
    try:
        assert http("GET", sim.url + "/metrics")[0] == 404
        # answers far longer than the test (aborted at its end): both still there when the third comes
        body = json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 30000}}).encode()
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(http("POST", sim.url + "/generate", body)[0]))
            for _ in range(2)
        ]

        def loads() -> dict:
            return json.loads(http("GET", sim.url + "/v1/loads")[1])["loads"][0]

        threads[0].start()
        wait_until_blocking(lambda: loads()["num_running_reqs"] == 1, "the first request running")
        threads[1].start()
        wait_until_blocking(lambda: loads()["num_waiting_reqs"] == 1, "the second request waiting")
        status, raw = http("POST", sim.url + "/generate", body)
        assert status == 503 and json.loads(raw) == {"detail": "The request queue is full."}
        client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
        try:
            client.completions.create(model="m", prompt="x", max_tokens=5)
            raise AssertionError("expected 503")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "queue is full" in str(exc)
        http("POST", sim.url + "/abort_request", b'{"abort_all": true}')
        for t in threads:
            t.join(15)
        assert len(results) == 2
    finally:
        sim.stop()


def test_prefill_oom_kills_the_server_with_sglangs_lines() -> None:
    sim = start_sim(
        "--sim-gpu",
        "rtx3080-10gb",
        "--quantization",
        "fp8",
        "--mem-fraction-static",
        "0.9",
        "--chunked-prefill-size",
        "8192",
    )
    try:
        status, _ = http(
            "POST",
            sim.url + "/generate",
            json.dumps({"input_ids": list(range(6000)), "sampling_params": {"max_new_tokens": 4}}).encode(),
        )
    except OSError:
        status = -1
    assert status != 200
    sim.proc.wait(10)
    assert sim.proc.returncode == 1
    sim.wait_for_line("SIGQUIT received")
    log = sim.log_text()
    assert "Scheduler hit an exception: Traceback" in log and "torch.OutOfMemoryError: CUDA out of memory" in log
    death = classify_death(sim.lines)
    assert (death.cause, death.phase, death.started) == ("oom", "prefill", True)


def test_weights_that_do_not_fit_exit_at_start() -> None:
    import subprocess
    import sys

    from tests.sim.helpers import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "proxy", "sim", "--sim-gpu", "rtx3080-10gb", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "Not enough memory" in out.stderr and out.stdout == ""


def test_unknown_flag_is_an_error_like_sglang() -> None:
    import subprocess
    import sys

    from tests.sim.helpers import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "proxy", "sim", "--cuda-graph-max-bs", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "ambiguous" in out.stderr
