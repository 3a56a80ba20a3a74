"""The coordinator's state directory is its user's only: 0700, and 0600 for what it writes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import python_env
from unbroken.config import ENV_SECRET_FILE
from unbroken.control.state.state_store import StateStore


@pytest.fixture
def lax_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual default: files 0644 and directories 0755 unless told
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_state_store_makes_its_directory_0700_and_its_database_0600(tmp_path: Path, lax_umask: None) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # made by the user, readable by everyone
    store = StateStore(state, journal_mode="wal")
    try:
        store.record_epoch(1, 0, [0], [])
        store.flush()
        files = {p.name: mode(p) for p in state.iterdir()}
    finally:
        store.close()
    assert mode(state) == 0o700
    assert {"coordinator.sqlite", "coordinator.sqlite-wal", "coordinator.sqlite-shm", "coordinator.lock"} <= set(files)
    assert files == dict.fromkeys(files, 0o600), files


def test_a_world_readable_database_left_by_an_older_version_becomes_0600(tmp_path: Path, lax_umask: None) -> None:
    state = tmp_path / "state"
    StateStore(state).close()
    os.chmod(state / "coordinator.sqlite", 0o644)
    os.chmod(state, 0o755)
    StateStore(state).close()
    assert (mode(state), mode(state / "coordinator.sqlite")) == (0o700, 0o600)


def test_unbroken_coordinator_writes_its_state_for_its_user_only(tmp_path: Path, lax_umask: None) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    env = {k: v for k, v in python_env().items() if k != ENV_SECRET_FILE}  # it makes the secret in --state-dir
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "coordinator", "--replicas", "1", "--port", "0"]
            + ["--state-dir", str(state), "--journal-mode", "wal"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while b"job secret:" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        modes = {p.name: mode(p) for p in state.rglob("*")}
    finally:
        proc.terminate()
        proc.wait(30)
    assert mode(state) == 0o700
    assert {"coordinator.sqlite", "secret"} <= set(modes) and any("lease" in n for n in modes), modes
    assert all(m == (0o700 if (state / n).is_dir() else 0o600) for n, m in modes.items()), modes
