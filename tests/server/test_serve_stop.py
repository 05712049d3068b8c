"""How ``pacer serve`` starts and stops, as a real process on real sockets in front of the simulated
worker.

- SIGTERM with requests in flight: they get ``proxy.shutdown_grace_s`` to end, then are ended, each
  with one answer (a stream with an error event, a whole answer with a 503), and the proxy exits with
  its worker stopped; a second signal ends the drain at once.
- A port in use: the proxy says so and exits before any worker launches, without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.harness.wait import wait_until

# answers of 8000 tokens: about 11 s on the simulated worker at ten times the modelled speed, far
# longer than the drains below take
LONG = 8000
POLICY = """\
[proxy]
gpu_sample_interval_s = 0
shutdown_grace_s = {grace}

[engine]
kind = "sim"
workers = 1
extra_args = ["--sim-time-scale", "10", "--sim-startup-seconds", "0", "--sim-output-fraction", "1",
              "--sim-output-spread", "0"]

[control]
mode = "off"
"""


@contextlib.contextmanager
def serving(folder: Path, grace_s: float, port: int = 0) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``pacer serve`` on ``folder/policy.toml`` (its state and worker logs under ``folder``); killed
    if it still runs when the block ends."""
    (folder / "policy.toml").write_text(POLICY.format(grace=grace_s))
    log_path = folder / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--policy", "policy.toml", "--port", str(port)],
            cwd=folder, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def ready_url(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 30.0) -> str:
    """The proxy's URL once its worker is ready."""

    def ready() -> str | None:
        text = log.read_text()
        m = re.search(r"listening on (http://\S+?) ", text)
        if m and "worker w0 is ready" in text:
            return m.group(1)
        assert proc.poll() is None, text[-3000:]
        return None

    return await wait_until(
        ready, "the proxy listening and w0 ready", timeout=timeout_s, every=0.05, detail=lambda: log.read_text()[-3000:]
    )


async def wait_log(proc: subprocess.Popen[bytes], log: Path, line: str, timeout_s: float = 10.0) -> None:
    def logged() -> bool:
        if line in log.read_text():
            return True
        assert proc.poll() is None, log.read_text()[-3000:]
        return False

    await wait_until(logged, f"{line!r} in the log", timeout=timeout_s, detail=lambda: log.read_text()[-3000:])


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for its reaper, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class InFlight:
    """Two long streams and one long whole answer, each as the client receives it."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.first_output = [asyncio.Event(), asyncio.Event()]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}
        self.streams = [asyncio.create_task(self._stream(session, url, body, seen)) for seen in self.first_output]
        self.whole = asyncio.create_task(self._whole(session, url, body))

    @staticmethod
    async def _stream(
        session: aiohttp.ClientSession, url: str, body: dict[str, Any], seen: asyncio.Event
    ) -> tuple[int, list[bytes]]:
        async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            events = []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    seen.set()
            return resp.status, events

    @staticmethod
    async def _whole(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json()

    async def started(self, session: aiohttp.ClientSession, url: str) -> int:
        """Once all three run on the worker (the streams with output out): the worker's pid."""
        for seen in self.first_output:
            await asyncio.wait_for(seen.wait(), 10)

        async def all_three_in_flight() -> int | None:
            async with session.get(url + "/admin/workers") as resp:
                (worker,) = (await resp.json())["workers"]
            return int(worker["pid"]) if worker["in_flight"] == 3 else None

        return await wait_until(all_three_in_flight, "all three requests in flight on the worker")

    async def answers(self) -> tuple[list[tuple[int, list[bytes]]], tuple[int, Any]]:
        streams = await asyncio.wait_for(asyncio.gather(*self.streams), 30)
        return streams, await asyncio.wait_for(self.whole, 30)


def assert_ended_by_the_proxy(streams: list[tuple[int, list[bytes]]], whole: tuple[int, Any]) -> None:
    """Each stream: output, then one error event (shutting_down) and [DONE]; the whole answer: a 503."""
    for status, events in streams:
        assert status == 200 and len(events) > 2 and events[-1] == b"[DONE]", events[-3:]
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and "incomplete" in error["message"], error
        assert all(b'"error"' not in e for e in events[:-2])
    status, body = whole
    assert status == 503 and body["error"]["code"] == "shutting_down", whole


@dataclass(frozen=True)
class Stopped:
    """How a proxy with three requests in flight stopped (exit code 0): seconds after SIGTERM, its log."""

    took_s: float
    log: str


async def stop_with_three_in_flight(tmp_path: Path, grace_s: float, second_signal: bool) -> Stopped:
    """Three requests in flight (two streams with output out, one whole answer), then SIGTERM (and,
    with ``second_signal``, SIGINT once the drain began): each ended by the proxy, the worker gone."""
    with serving(tmp_path, grace_s=grace_s) as (proc, log):
        url = await ready_url(proc, log)
        async with aiohttp.ClientSession() as session:
            requests = InFlight(session, url)
            worker_pid = await requests.started(session, url)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if second_signal:
                await wait_log(proc, log, f"waiting at most {grace_s:g} s for them to end")
                proc.send_signal(signal.SIGINT)
            streams, whole = await requests.answers()
            code = await asyncio.to_thread(proc.wait, 30)
            took = time.monotonic() - signalled
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert_ended_by_the_proxy(streams, whole)
    assert "Traceback" not in text and text.splitlines()[-1].endswith("stopped"), text[-3000:]
    assert not alive(worker_pid)
    return Stopped(took, text)


@pytest.mark.timeout(90)
async def test_sigterm_ends_the_requests_in_flight_after_the_grace_and_stops_the_worker(tmp_path: Path) -> None:
    stopped = await stop_with_three_in_flight(tmp_path, 1.0, second_signal=False)
    text = stopped.log
    assert "stopping: 3 request(s) in flight, waiting at most 1 s for them to end" in text, text[-3000:]
    assert re.search(r"ending 3 request\(s\) still in flight after 1\.\d s", text), text[-3000:]  # polled
    # a second or so; the bound leaves a starved CPU room, under the ~11 s the answers would take to end
    assert stopped.took_s < 8, f"stopped {stopped.took_s:.1f} s after SIGTERM (a grace of 1 s); answers take ~11 s"


@pytest.mark.timeout(90)
async def test_a_second_signal_ends_the_drain_at_once(tmp_path: Path) -> None:
    stopped = await stop_with_three_in_flight(tmp_path, 60.0, second_signal=True)
    text = stopped.log
    assert "SIGINT, a second signal: stopping now" in text and "(stopped now)" in text, text[-3000:]
    # at once (a grace of 60 s); the bound leaves a starved CPU room, under the ~11 s the answers take
    assert stopped.took_s < 8, f"stopped {stopped.took_s:.1f} s after the first signal; answers take ~11 s"


@pytest.mark.timeout(60)
def test_a_port_in_use_stops_before_any_worker_launches(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with serving(tmp_path, grace_s=1.0, port=port) as (proc, log):
            code = proc.wait(30)
    text = log.read_text()
    assert code == 1, text[-3000:]
    lines = text.splitlines()
    assert lines[-1].endswith(f"cannot listen on 127.0.0.1:{port}: address already in use"), text[-3000:]
    assert "Traceback" not in text and "Error" not in text, text[-3000:]
    assert "worker w0" not in text and not (tmp_path / ".pacer").exists(), "a worker was launched: " + text[-3000:]


async def test_the_bound_port_is_held_before_it_is_served() -> None:
    from proxy.compose import CannotListen, serve
    from proxy.server.protocol import Listener

    listener = await Listener.bind("127.0.0.1", 0)
    try:
        with socket.socket() as other, pytest.raises(OSError):  # another SO_REUSEADDR server, meanwhile
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", listener.port))
            other.listen()
    finally:
        listener.close()
    with pytest.raises(CannotListen, match=r"cannot listen on no-such-host\.invalid:8000: \w"):
        await serve(None, "no-such-host.invalid", 8000)  # type: ignore[arg-type]  # refused before the app


async def test_the_controllers_stop_before_the_drain(make_proxy) -> None:  # type: ignore[no-untyped-def]
    # a restart, a revival or a canary decided while the requests in flight end would cut them
    h = await make_proxy(policy={"control": {"mode": "auto"}})
    st = h.state
    running_at_drain: list[str] = []
    drain = st.drain.run

    async def run(requests):  # type: ignore[no-untyped-def]
        tasks = asyncio.all_tasks()
        running_at_drain.extend(
            t.get_name() for t in tasks if t.get_name().startswith("pacer-controller-") and not t.done()
        )
        await drain(requests)

    assert any(t.get_name().startswith("pacer-controller-") for t in asyncio.all_tasks())
    st.drain.run = run  # type: ignore[method-assign]
    await h.stop()
    assert running_at_drain == [] and st.stop_control is None
