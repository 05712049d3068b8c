"""A command's output piped into ``head``: the reader closes the pipe early, and the command ends
quietly (exit 0, no BrokenPipeError traceback), as ``pacer decisions | head`` should."""

from __future__ import annotations

import subprocess
import sys


def flood(argv: list[str]) -> int:
    """A stand-in subcommand that prints far more than a pipe holds."""
    for n in range(200_000):
        print(f"line {n} " + "x" * 60)
    return 0


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    code = (
        "import sys, proxy.cli as cli; cli.SUBCOMMANDS['flood'] = 'tests.test_cli_pipe:flood'; "
        "sys.exit(cli.main(['flood']))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"line 0")
    proc.stdout.close()  # what head does once it has its lines
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]


def test_decisions_refuses_a_negative_limit_and_an_unknown_status(capsys) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from proxy.cli import main

    for argv, said in ((["--limit", "-1"], "expected 0 or more"), (["--status", "nope"], "invalid choice")):
        with pytest.raises(SystemExit) as ended:
            main(["decisions", "--url", "http://127.0.0.1:9", *argv])
        assert ended.value.code == 2 and said in capsys.readouterr().err
