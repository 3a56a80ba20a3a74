"""``unbroken agent`` rejects bad arguments with a message that says what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from unbroken.cli import main
from unbroken.wire.auth import JobSecret


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "python", "t.py"], "Missing option '--coordinator'"),
        (["--coordinator", "nohost", "--", "python", "t.py"], "--coordinator must look like HOST:PORT"),
        (["--coordinator", "127.0.0.1:29510", "--slots", "0", "--", "python", "t.py"], "--slots must be >= 1"),
        (["--coordinator", "127.0.0.1:29510", "--node", "", "--", "python", "t.py"], "--node must be a non-empty name"),
        (
            ["--coordinator", "127.0.0.1:29510", "--max-restarts", "-1", "--", "python", "t.py"],
            "--max-restarts must be >= 0",
        ),
        (["--coordinator", "127.0.0.1:29510"], "Missing argument 'COMMAND"),
    ],
)
def test_bad_arguments(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["agent", "--run-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_an_unreachable_coordinator_is_named(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = JobSecret.generate().write(tmp_path / "secret")
    result = CliRunner().invoke(
        main,
        [
            "agent",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--connect-timeout",
            "0.3",
            "--run-dir",
            str(tmp_path),
            "--secret-file",
            str(secret),
            "--",
            "python",
            "t.py",
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"no coordinator answered at 127.0.0.1:{port}" in result.output
    assert "start `unbroken coordinator`" in result.output


def test_without_the_jobs_secret_the_agent_says_where_to_find_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UNBROKEN_SECRET_FILE", raising=False)
    result = CliRunner().invoke(
        main, ["agent", "--coordinator", "127.0.0.1:29510", "--run-dir", str(tmp_path), "--", "python", "t.py"]
    )
    assert result.exit_code == 2, result.output
    assert "--secret-file" in result.output and "--state-dir" in result.output
