"""Bad configuration fails fast with a message that says what to fix."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tests.integration.harness import TRAIN, python_env
from unbroken.cli import main


def test_worker_without_a_coordinator_says_how_to_launch() -> None:
    env = {k: v for k, v in python_env().items() if not k.startswith("UNBROKEN_")}
    out = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "UNBROKEN_COORDINATOR is not set" in out.stderr and "unbroken run" in out.stderr


def test_worker_with_an_unreachable_coordinator_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: nobody answers
        env = {
            **python_env(),
            "UNBROKEN_COORDINATOR": f"127.0.0.1:{port}",
            "UNBROKEN_REPLICA_ID": "0",
            "UNBROKEN_NUM_REPLICAS": "1",
            "UNBROKEN_CONNECT_TIMEOUT": "2",
        }
        out = subprocess.run(
            [sys.executable, str(TRAIN), "--steps", "1"], env=env, capture_output=True, text=True, timeout=60
        )
    assert out.returncode != 0
    assert "no coordinator answered" in out.stderr


def test_wrong_replica_counts_are_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(main, ["run", "--replicas", "0", "--run-dir", str(tmp_path), "--", "true"])
    assert r.exit_code == 2 and "--replicas must be >= 1" in r.output
    r = runner.invoke(main, ["run", "--replicas", "2", "--min-replicas", "3", "--run-dir", str(tmp_path), "--", "true"])
    assert r.exit_code == 2 and "--min-replicas must be between 1 and --replicas" in r.output
    r = runner.invoke(
        main, ["run", "--replicas", "2", "--coordinator", "nohost", "--run-dir", str(tmp_path), "--", "true"]
    )
    assert r.exit_code == 2 and "HOST:PORT" in r.output


def test_coordinator_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(
            main, ["coordinator", "--replicas", "2", "--port", str(port), "--state-dir", str(tmp_path)]
        )
    assert r.exit_code == 2 and "cannot listen" in r.output and "--port" in r.output
