"""What a run writes is the job's own: its directory, logs, events, metrics, final states and
checkpoints are 0700/0600 even under the usual 022 umask (a shared machine's other users)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.integration.harness import Job

pytestmark = pytest.mark.integration


def test_a_runs_files_are_readable_by_its_user_only(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    old = os.umask(0o022)  # the launcher inherits it: files 0644 and directories 0755 otherwise
    try:
        with Job(
            tmp_path / "run",
            replicas=2,
            steps=6,
            extra=["--checkpoint-dir", str(ckpt)],
            train_args=["--pace-s", "0.05", "--checkpoint-every", "3"],
        ) as job:
            assert job.wait(120) == 0
    finally:
        os.umask(old)
    seen = {"logs": 0, "events": 0, "metrics": 0, "final": 0, "checkpoint": 0}
    for tree in (tmp_path / "run", ckpt):
        for path in [tree, *tree.rglob("*")]:
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or stat.S_ISSOCK(mode):
                continue
            want = 0o700 if stat.S_ISDIR(mode) else 0o600
            assert mode & 0o777 == want, f"{path} is {oct(mode & 0o777)}"
            name = path.name
            for key, hit in (
                ("logs", name.endswith(".log")),
                ("events", name == "events.jsonl"),
                ("metrics", name.startswith("metrics-")),
                ("final", name.startswith("final-")),
                ("checkpoint", name == "data.safetensors"),
            ):
                seen[key] += hit
    assert all(seen.values()), seen  # each kind of file was there to be checked
