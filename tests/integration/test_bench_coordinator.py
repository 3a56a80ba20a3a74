"""``unbroken bench coordinator`` end to end, at a size the suite can afford.

One real coordinator and its standby, simulated groups in two processes over the real protocol:
every figure the issue asks for comes out, the fast path's answers are short, the standby takes
over after the kill -9 and every group is answered by it. No timing is asserted (a busy machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import python_env

pytestmark = pytest.mark.integration


def test_bench_coordinator_measures_every_figure_and_the_standby_takes_over(tmp_path: Path) -> None:
    out = tmp_path / "coordinator.json"
    args = [sys.executable, "-m", "unbroken", "bench", "coordinator", "--sizes", "4", "--step-time", "0.3"]
    done = subprocess.run([*args, "--out", str(out)], env=python_env(), capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    (row,) = json.loads(out.read_text())["sizes"]
    assert "error" not in row, row
    assert row["replica_groups"] == 4 and row["fast_answers"] == 4 * 6  # every group, every fast-path step
    for key in ("quorum_p50_ms", "quorum_p99_ms", "disconnect_to_epoch_ms", "rejoin_admit_ms", "takeover_ms"):
        assert isinstance(row[key], float) and row[key] > 0, key
    assert row["cpu_ms_per_step"] >= 0 and row["rss_mib"] > 0
    assert row["bytes_per_client_step"] < 200  # a short answer per step, not the membership
    assert row["client_cpu_util"] < 1.0


def test_bench_coordinator_nodes_answers_every_rank_of_every_node_through_one_connection(tmp_path: Path) -> None:
    """``--nodes``: each node's 8 ranks through one connection; the same figures, per node."""
    out = tmp_path / "coordinator.json"
    args = [sys.executable, "-m", "unbroken", "bench", "coordinator", "--nodes", "4", "--step-time", "0.3"]
    done = subprocess.run([*args, "--out", str(out)], env=python_env(), capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(out.read_text())
    (row,) = result["sizes"]
    assert "error" not in row, row
    assert result["ranks_per_node"] == 8 and row["nodes"] == 4 and row["ranks"] == 32
    assert row["fast_answers"] == 4 * 6  # every node, every fast-path step: all its ranks in one answer
    for key in ("quorum_p50_ms", "quorum_p99_ms", "disconnect_to_epoch_ms", "rejoin_admit_ms", "takeover_ms"):
        assert isinstance(row[key], float) and row[key] > 0, key
    # One line per node per step whose short answer, the same for its eight ranks, goes once
    # (with the count of ranks it is for): not eight lines, eight copies, nor the membership.
    assert 40 < row["bytes_per_client_step"] < 8 * 40


def test_bench_coordinator_refuses_sizes_and_nodes_together() -> None:
    args = [sys.executable, "-m", "unbroken", "bench", "coordinator", "--sizes", "4", "--nodes", "4"]
    done = subprocess.run(args, env=python_env(), capture_output=True, timeout=60)
    assert done.returncode == 2 and b"not both" in done.stderr
