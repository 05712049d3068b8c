"""A ``pacer serve`` process killed with SIGKILL in the middle of a batch, started again on the same
policy: the batch resumes and every ``custom_id`` is answered exactly once, none in both files.

The simulated worker is a process of the test's own (an external worker to the proxy), so it keeps
running across the kill, as a real engine would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import openai

from proxy.workers.supervisor import free_port
from tests.batch.conftest import CHAT, content_lines, jsonl, request_line, wait_final_over_http
from tests.harness.wait import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LINES = 24

POLICY = """
[engine]
kind = "external"
urls = ["{worker}"]
speaks = "sglang"
[pacing]
queue_band = [1, 4]
headroom = 0
scrape_interval_s = 0.05
stale_after_s = 1.0
[batch]
dir = "batches"
concurrency = 4
"""


@contextmanager
def _process(argv: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _ready(url: str, log: Path) -> None:
    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
                workers = (await r.json())["workers"]
        except (aiohttp.ClientError, OSError, ValueError, KeyError):
            return False
        return bool(workers) and all(w["state"] == "ready" and w["sample"] for w in workers)

    try:
        await wait_until(up, "the proxy up with every worker ready and sampled", timeout=60)
    except TimeoutError:
        raise AssertionError("the proxy did not get ready; its log:\n" + log.read_text()[-3000:]) from None


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0, timeout=30)


def _serve() -> tuple[list[str], str]:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "proxy", "serve", "--policy", "policy.toml", "--port", str(port)]
    return argv, f"http://127.0.0.1:{port}"


async def test_a_proxy_killed_mid_batch_resumes_it_exactly_once(tmp_path: Path) -> None:
    worker_port = free_port("127.0.0.1")
    sim = [sys.executable, "-m", "proxy", "sim", "--port", str(worker_port), "--max-running-requests", "4"]
    sim += ["--sim-time-scale", "2", "--sim-startup-seconds", "0.2"]
    (tmp_path / "policy.toml").write_text(POLICY.format(worker=f"http://127.0.0.1:{worker_port}"))
    log = tmp_path / "pacer.log"
    ids = [f"line-{n:02d}" for n in range(LINES)]
    lines = [request_line(i, model=MODEL, max_tokens=64, sim_output_len=64) for i in ids]

    with _process(sim, tmp_path, tmp_path / "worker.log"):
        argv, url = _serve()
        with _process(argv, tmp_path, log) as first:
            await _ready(url, log)
            async with _client(url) as client:
                uploaded = await client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
                created = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")

                async def partly_done() -> bool:
                    counts = (await client.batches.retrieve(created.id)).request_counts
                    return counts is not None and counts.completed >= 4

                await wait_until(partly_done, "four requests completed", timeout=60)
                first.kill()
                first.wait()

        argv, url = _serve()
        with _process(argv, tmp_path, log):
            await _ready(url, log)
            async with _client(url) as client:
                found = await client.batches.retrieve(created.id)
                batch = await wait_final_over_http(client, created.id)
                assert batch.status == "completed" and batch.error_file_id is None, batch
                assert batch.output_file_id is not None
                output = await content_lines(client, batch.output_file_id)

    assert found.status == "in_progress" and found.request_counts is not None
    assert 4 <= found.request_counts.completed < LINES  # the kill landed in the middle of the batch
    assert [line["custom_id"] for line in output] == ids  # each exactly once, in input order
    assert all(line["response"]["status_code"] == 200 for line in output)
