"""The operator's commands: ``pacer decisions`` prints times local with their zone; ``pacer status``
refuses a bad URL or interval, waits out an unreachable proxy with ``--watch``, and names the admin key on a 401."""

from __future__ import annotations

import re
import time

import pytest

from proxy.console.decisions import format_decision


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TZ", "CET-1CEST,M3.5.0,M10.5.0/3")  # POSIX rule: no tzdata needed
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("berlin")
def test_a_decision_time_is_printed_local_with_its_zone() -> None:
    entry = {"id": 3, "time": "2026-11-28T12:00:05.250+00:00", "worker": "w0", "rule": "r", "status": "noted"}
    assert format_decision(entry).startswith("#3 2026-11-28 13:00:05 CET w0 r [noted]")
    summer = dict(entry, time="2026-07-01T12:00:05")  # a time with no zone is the journal's UTC
    assert "2026-07-01 14:00:05 CEST" in format_decision(summer)
    assert "not-a-time" in format_decision(dict(entry, time="not-a-time"))


def test_the_url_is_the_proxys_base_an_openai_base_url_taken_as_it() -> None:
    from proxy.console.admin import base_url

    assert base_url("http://10.0.0.5:8000/v1/") == "http://10.0.0.5:8000"  # pasted from the client's config
    assert base_url("https://pacer.example") == "https://pacer.example"
    for bad in ("notaurl", "10.0.0.5:8000", "ftp://h"):
        with pytest.raises(ValueError, match="expected the proxy's URL"):
            base_url(bad)


def test_status_refuses_a_bad_url_and_interval_and_shows_when_decisions_are_hidden(capsys) -> None:  # type: ignore[no-untyped-def]
    from proxy.cli import main
    from proxy.console.status import format_status

    for argv, said in ((["--url", "notaurl"], "expected the proxy's URL"), (["--interval", "0"], "> 0")):
        with pytest.raises(SystemExit) as ended:
            main(["status", *argv])
        assert ended.value.code == 2 and said in capsys.readouterr().err  # a usage error, not a traceback
    decisions = {"decisions": [{"id": 1, "time": "2026-11-28T12:00:00", "worker": "w0", "rule": "r"}]}
    assert "decisions not shown (--last 0)" in format_status({"workers": []}, decisions, 0)
    assert "no decisions yet" in format_status({"workers": []}, {"decisions": []}, 0)


def test_status_says_why_a_worker_is_not_serving() -> None:
    from proxy.console.status import format_status

    down = {"id": "w0", "state": "down", "last_error": "killed by SIGKILL; it stays down (control.mode = off)"}
    shown = format_status({"workers": [down, {**down, "id": "w1", "state": "ready"}]}, {"decisions": []}, 0)
    assert shown.count("why: killed by SIGKILL; it stays down (control.mode = off)") == 1  # the down one's only
    long = format_status({"workers": [{**down, "last_error": "x" * 1000}]}, {"decisions": []}, 0)
    assert "why: " + "x" * 237 + "...\n" in long and "x" * 238 not in long


def test_status_watch_waits_out_an_unreachable_proxy(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from proxy.cli import main

    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("proxy.console.status.time.sleep", nap)
    assert main(["status", "--watch", "--interval", "0.5", "--url", "http://127.0.0.1:9"]) == 0
    out = capsys.readouterr().out
    assert out.count("cannot reach the proxy at http://127.0.0.1:9") == 2 and "trying again in 0.5 s" in out


def test_a_refused_admin_call_names_the_admin_key(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from proxy.console.admin import AdminClient, AdminError

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": {"message": "admin key required"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Refuse) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.delenv("PACER_ADMIN_KEY", raising=False)
        client = AdminClient(f"http://127.0.0.1:{server.server_address[1]}", None)
        with pytest.raises(
            AdminError, match=r"answered 401: admin key required \(the admin key: --admin-key or \$PACER_ADMIN_KEY\)"
        ):
            client.get("/admin/workers")
        server.shutdown()


def test_the_proxys_log_marks_warnings_and_errors() -> None:
    import logging

    from proxy.cli import LogFormat

    def line(level: int, message: str) -> str:
        record = logging.LogRecord("proxy", level, __file__, 1, message, None, None)
        return LogFormat().format(record)

    assert re.fullmatch(
        r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] worker w0 is ready", line(logging.INFO, "worker w0 is ready")
    )
    assert re.fullmatch(
        r"\[[\d :-]+\] WARNING worker w0 died \(exited\)", line(logging.WARNING, "worker w0 died (exited)")
    )
    assert re.fullmatch(r"\[[\d :-]+\] ERROR cannot listen", line(logging.ERROR, "cannot listen"))
