"""A real PostgreSQL server for tests and benchmarks: Debian's ``postgresql`` binaries, a fresh cluster.

:func:`local_postgres` runs ``initdb`` in a temporary directory, starts ``postgres`` on a free port of
127.0.0.1 (its unix socket in the same directory), and stops it and removes the directory on exit.
As root (CI) the server runs as the ``postgres`` user the package creates: PostgreSQL refuses root.
:func:`postgres_bin` is None where the binaries are absent (``make postgres`` installs them); the
tests skip then, saying so. The fixtures: ``postgres`` (one server a session), ``postgres_url`` (a
fresh database a test), ``store_url`` (the Batch API's tests on both backends), ``own_postgres`` (a
server a test stops and starts again). ``durable=False`` (tests) turns ``fsync`` off; a benchmark keeps the
defaults, as a real deployment would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness.wait import wait_until_blocking

_databases = itertools.count(1)
MISSING = "PostgreSQL's binaries are absent (/usr/lib/postgresql/*/bin): `make postgres` installs Debian's package"


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory, None when none is."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PostgresServer:
    port: int
    bin_dir: Path
    process: _ServerProcess | None = field(default=None, compare=False, repr=False)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://pacer@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Shut the server down (its clients' sessions end); :meth:`start` brings it back, same data and port."""
        assert self.process is not None
        self.process.stop()

    def start(self) -> None:
        assert self.process is not None
        self.process.start()


def _as_server_user(folder: Path) -> dict[str, Any]:
    """Popen's arguments that run the server as the ``postgres`` user when this process is root (that
    user owns ``folder`` then); the server stays this process's child, so signals reach it."""
    if os.geteuid() != 0:
        return {"cwd": folder}
    user = pwd.getpwnam("postgres")
    os.chown(folder, user.pw_uid, user.pw_gid)
    return {"cwd": folder, "user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _ready(port: int) -> bool:
    """The server answers a query (it accepts connections before it has started up)."""
    import psycopg

    try:
        with psycopg.connect(f"postgresql://pacer@127.0.0.1:{port}/postgres", connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


class _ServerProcess:
    """The ``postgres`` process of one cluster, stopped and started again on the same port and data."""

    def __init__(self, argv: list[str], folder: Path, port: int) -> None:
        self._argv, self._folder, self._port = argv, folder, port
        self._log = folder / "server.log"
        self._server: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self._log.open("ab") as out:
            server = subprocess.Popen(self._argv, stdout=out, stderr=subprocess.STDOUT, **_as_server_user(self._folder))
        self._server = server
        wait_until_blocking(
            lambda: server.poll() is not None or _ready(self._port),
            "PostgreSQL accepting connections",
            detail=lambda: self._log.read_text(errors="replace")[-2000:],
        )
        if server.poll() is not None:
            raise RuntimeError(f"PostgreSQL did not start:\n{self._log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.send_signal(signal.SIGINT)  # a fast shutdown: it ends the clients' sessions
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def local_postgres(*, durable: bool = False) -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster served until the block ends; RuntimeError when the binaries are absent."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError(MISSING)
    folder = Path(tempfile.mkdtemp(prefix="pacer-pg-"))  # short: a unix socket's path has a small limit
    data = folder / "data"
    try:
        init = [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "pacer", "-E", "UTF8", "--no-sync"]
        subprocess.run(init, check=True, capture_output=True, **_as_server_user(folder))
        port = _free_port()
        settings = ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={folder}"]
        if not durable:
            settings += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        process = _ServerProcess([str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), *settings], folder, port)
        try:
            process.start()
            yield PostgresServer(port, bin_dir, process)
        finally:
            process.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- pytest fixtures (a plugin of tests/conftest.py) ----------------------------------------------------


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One server for the session; each test takes a database of its own (:func:`postgres_url`)."""
    yield from _started()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of the test's own, which it may stop and start again (:meth:`PostgresServer.stop`)."""
    yield from _started()


def _started() -> Iterator[PostgresServer]:
    """A local server for as long as the fixture lasts; the test is skipped where none can run here."""
    if postgres_bin() is None:
        pytest.skip(MISSING)
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
    with local_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> str:
    """A fresh, empty database on the session's server."""
    return postgres.create_database(f"t{next(_databases)}")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The Batch API's store on each backend: "" (the embedded SQLite) and a fresh PostgreSQL database."""
    return "" if request.param == "sqlite" else str(request.getfixturevalue("postgres_url"))
