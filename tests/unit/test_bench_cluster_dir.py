"""``unbroken bench cluster`` twice on one run directory: the second run starts empty, the first's
files are kept aside, and a directory it did not make is never touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.bench.network.cluster import MARKER, fresh_run_dir


def test_a_second_run_starts_empty_and_keeps_the_first_aside(tmp_path: Path) -> None:
    run = tmp_path / "cluster-run"
    fresh_run_dir(run)
    (run / "partition_host").mkdir()
    (run / "partition_host" / "secret").write_text("first")
    fresh_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == [MARKER]
    assert (tmp_path / "cluster-run.previous" / "partition_host" / "secret").read_text() == "first"
    (run / "x").write_text("second")
    fresh_run_dir(run)  # the one before the previous goes
    assert (tmp_path / "cluster-run.previous" / "x").read_text() == "second"


def test_a_directory_it_did_not_make_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="give an empty --run-dir"):
        fresh_run_dir(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"
    fresh_run_dir(tmp_path / "empty")  # an empty or missing one is fine
