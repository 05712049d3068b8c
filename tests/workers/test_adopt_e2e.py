"""Engines outlive the proxy: a real ``pacer serve`` in front of simulated workers, killed outright.

- SIGKILLed under load and started again, it adopts every worker: the same pids, the first request
  answered by the same server (its own start time unchanged, no launch in its log), and a clean
  stop after that still stops them;
- SIGKILLed and never started again, its workers stop by themselves once their lease lapses, and
  their ports are free after;
- ``engine.keep_on_exit``: a clean stop leaves them running for the next proxy, which adopts them;
- a worker whose policy changed while no proxy ran is adopted, then restarted with the new arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.workers.lease import proc_start, read_lease
from proxy.workers.supervisor import free_port, port_is_free
from tests.harness.wait import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux's")

POLICY = """
[engine]
kind = "sim"
workers = 2
stop_grace_s = 2.0
startup_timeout_s = 60.0
keep_on_exit = {keep}

[engine.args]
sim_time_scale = 20.0
sim_startup_seconds = 0.3
enable_metrics = true
max_running_requests = {running}

[control]
mode = "off"
"""


class Serve:
    """``pacer serve`` in ``folder``, its lease shortened to ``lease_s``; stopped when the block ends."""

    def __init__(self, folder: Path, lease_s: float) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"pacer-{self.port}.log"
        env = {**os.environ, "PACER_WORKER_LEASE_S": str(lease_s)}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--policy", "policy.toml", "--port", str(self.port)],
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def stop(self, sig: signal.Signals = signal.SIGTERM, grace_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@contextlib.contextmanager
def serving(folder: Path, lease_s: float) -> Iterator[Serve]:
    serve = Serve(folder, lease_s)
    try:
        yield serve
    finally:
        serve.stop()


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """The proxy's folder; every worker process a lease there names is gone when the test ends."""
    yield tmp_path
    for lease in (tmp_path / ".pacer" / "logs").glob("*.lease"):
        record = read_lease(lease) or {}
        if isinstance(record.get("pid"), int) and proc_start(record["pid"]) == record.get("pid_start"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record["pid"], signal.SIGKILL)


def write_policy(folder: Path, *, keep: bool = False, running: int = 64) -> None:
    (folder / "policy.toml").write_text(POLICY.format(keep=str(keep).lower(), running=running))


async def until(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 60.0) -> Any:
    """``check()``'s first truthy answer, a proxy that does not answer yet counting as no (:func:`wait_until`)."""

    async def answered() -> Any:
        with contextlib.suppress(aiohttp.ClientError, OSError, ValueError, KeyError):
            return await check()
        return None

    return await wait_until(answered, what, timeout=timeout, every=0.1)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        return await r.json(content_type=None)


async def ready_workers(serve: Serve, count: int = 2) -> dict[str, dict[str, Any]]:
    async def ready() -> dict[str, dict[str, Any]] | None:
        assert serve.proc.poll() is None, "pacer serve exited:\n" + serve.log.read_text()[-3000:]
        ws = {w["id"]: w for w in (await get_json(serve.url + "/admin/workers"))["workers"]}
        return ws if len(ws) == count and all(w["state"] == "ready" and w["pid"] for w in ws.values()) else None

    return dict(await until(ready, "every worker ready"))


async def started_at(worker: dict[str, Any]) -> float:
    """The server's own start time (its /server_info)."""
    return float((await get_json(worker["url"] + "/server_info"))["startup_time"])


def alive(pid: int) -> bool:
    return proc_start(pid) is not None


async def ask(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    async with client:
        models = await client.models.list()
        r = await client.chat.completions.create(
            model=models.data[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    return r.choices[0].message.content or ""


async def load(url: str, stop: asyncio.Event, answered: list[str]) -> None:
    """Requests back to back until ``stop`` (those cut by the proxy's death fail: that is the point)."""
    while not stop.is_set():
        with contextlib.suppress(openai.APIError, aiohttp.ClientError, OSError):
            answered.append(await ask(url))


async def test_a_proxy_killed_under_load_adopts_its_workers_and_a_clean_stop_still_stops_them(folder: Path) -> None:
    write_policy(folder)
    with serving(folder, lease_s=30.0) as first:
        before = await ready_workers(first)
        starts = {wid: await started_at(w) for wid, w in before.items()}
        stop, answered = asyncio.Event(), list[str]()
        loaders = [asyncio.create_task(load(first.url, stop, answered)) for _ in range(4)]

        async def loaded() -> bool:
            return len(answered) >= 8

        await until(loaded, "the load on the proxy")
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        stop.set()
        await asyncio.gather(*loaders)
    assert all(alive(w["pid"]) for w in before.values()), "a worker died with the proxy"

    with serving(folder, lease_s=30.0) as second:
        after = await ready_workers(second)
        assert {wid: w["pid"] for wid, w in after.items()} == {wid: w["pid"] for wid, w in before.items()}
        assert {wid: w["url"] for wid, w in after.items()} == {wid: w["url"] for wid, w in before.items()}
        assert await ask(second.url)
        assert {wid: await started_at(w) for wid, w in after.items()} == starts  # no reload
        for wid in after:
            text = (folder / ".pacer" / "logs" / f"{wid}.log").read_text()
            assert text.count("pacer: start: worker") == 1 and "pacer: adopted: worker" in text
        assert second.stop() == 0
    for w in after.values():
        assert not alive(w["pid"]), "a clean stop left a worker running"
        assert port_is_free("127.0.0.1", int(w["url"].rsplit(":", 1)[1]))
    assert not list((folder / ".pacer" / "logs").glob("*.lease"))


async def test_workers_whose_proxy_never_comes_back_stop_within_their_lease(folder: Path) -> None:
    write_policy(folder)
    lease_s = 2.0
    with serving(folder, lease_s=lease_s) as serve:
        workers = await ready_workers(serve)
        serve.stop(signal.SIGKILL)
        killed = time.monotonic()
    pids = [w["pid"] for w in workers.values()]
    assert all(alive(pid) for pid in pids)

    async def all_gone() -> bool:
        return not any(alive(pid) for pid in pids)

    # the lease, the check interval, the grace (2 s): a minute in production, seconds here; the bound
    # leaves a starved CPU 10 s over them (the watcher's own waits are on its clock: a SIGKILL ends them)
    await until(all_gone, "the workers to stop on their own", timeout=lease_s + 2.0 + 30.0)
    assert time.monotonic() - killed < lease_s + 2.0 + 10.0
    for w in workers.values():
        assert port_is_free("127.0.0.1", int(w["url"].rsplit(":", 1)[1]))
        assert "the lease was not renewed" in (folder / ".pacer" / "logs" / f"{w['id']}.log").read_text()


async def test_keep_on_exit_leaves_the_workers_to_the_next_proxy(folder: Path) -> None:
    write_policy(folder, keep=True)
    with serving(folder, lease_s=30.0) as first:
        before = await ready_workers(first)
        assert first.stop() == 0
    assert all(alive(w["pid"]) for w in before.values())
    with serving(folder, lease_s=30.0) as second:
        after = await ready_workers(second)
        assert {w["pid"] for w in after.values()} == {w["pid"] for w in before.values()}
        assert await ask(second.url)
        assert second.stop() == 0
    assert all(alive(w["pid"]) for w in after.values())  # left again: the fixture ends them


async def test_a_worker_whose_policy_changed_is_adopted_then_restarted_with_the_new_arguments(folder: Path) -> None:
    write_policy(folder, running=64)
    with serving(folder, lease_s=30.0) as first:
        before = await ready_workers(first)
        first.stop(signal.SIGKILL)
    write_policy(folder, running=32)
    with serving(folder, lease_s=30.0) as second:

        async def restarted() -> dict[str, dict[str, Any]] | None:
            ws = await ready_workers(second)
            new = all(ws[wid]["pid"] != w["pid"] and ws[wid]["args"].get("max_running_requests") == 32
                      for wid, w in before.items())  # fmt: skip
            return ws if new else None

        after = await until(restarted, "the adopted workers restarted with the new arguments")
        assert await ask(second.url)
        for wid, w in after.items():
            assert (await get_json(w["url"] + "/server_info"))["max_running_requests"] == 32
            assert not alive(before[wid]["pid"])
            text = (folder / ".pacer" / "logs" / f"{wid}.log").read_text()
            assert "pacer: adopted: worker" in text and "its policy changed while no proxy ran" in text
