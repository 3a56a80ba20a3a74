"""A job's secret file is written whole or not at all: a crash or a full disk never empties it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from unbroken.control.state import secret_file
from unbroken.wire.auth import JobSecret


@pytest.fixture
def lax_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_secret_is_written_0600_atomically_and_never_over_another(tmp_path: Path, lax_umask: None) -> None:
    path = tmp_path / "dir" / "secret"
    first = JobSecret.generate()
    first.write(path)
    assert mode(path) == 0o600 and JobSecret.load(path).key == first.key
    with pytest.raises(FileExistsError):
        JobSecret.generate().write(path)
    assert JobSecret.load(path).key == first.key
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left


def test_a_failed_write_leaves_the_earlier_secret_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, path = secret_file.fresh(tmp_path)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        secret_file.fresh(tmp_path)  # unbroken run's fresh secret over the last run's
    monkeypatch.undo()
    assert JobSecret.load(path).key == old.key  # not emptied, not half written
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]
    new, again = secret_file.fresh(tmp_path)
    assert again == path and JobSecret.load(path).key == new.key != old.key and mode(path) == 0o600
