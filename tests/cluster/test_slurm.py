"""The README's Slurm example under a real Slurm in the cluster box (``unbroken bench cluster --slurm``).

The scenario is ``scenario``-marked (``make scenarios``, which installs slurm-wlm and munge as
root) and skipped, saying what to run, where they are missing. The documentation check is plain
and fast: the sbatch script the box runs and the one docs/operations.md shows must keep the
same ``srun`` lines and ``--no-kill``, without which Slurm ends the job when a node dies.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unbroken.cluster import scenarios
from unbroken.cluster.slurm import batch_script, missing

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_script() -> str:
    section = DOCS.read_text().split("\n## Slurm\n", 1)[1]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found, "docs/operations.md's Slurm section lost its sbatch script"
    return found.group(1)


def test_the_documented_slurm_script_has_the_srun_lines_the_box_runs(tmp_path: Path) -> None:
    docs = [re.sub(r"\s+#.*", "", line).strip() for line in documented_script().splitlines()]
    box = batch_script(tmp_path, ["python", "-m", "unbroken.cluster.worker"])
    srun_lines = [line.strip() for line in box.splitlines() if line.startswith("srun ")]
    assert len(srun_lines) == 2
    for line in srun_lines:
        assert line in docs, f"the box runs `{line}` but docs/operations.md's script does not have it"
    assert "#SBATCH --no-kill" in docs, "without --no-kill Slurm cancels (and requeues) the job when a node dies"


@pytest.mark.integration
@pytest.mark.scenario
@pytest.mark.usefixtures("box_available")
def test_the_slurm_example_under_real_slurm_continues_on_the_spare_after_a_power_cut(tmp_path: Path) -> None:
    why = missing()
    if why is not None:
        pytest.skip(f"no Slurm here: {why}")
    record = scenarios.slurm(tmp_path, quick=True)
    failed = [k for k, ok in record["checks"].items() if not ok]
    assert not failed, f"slurm: failed checks {failed}; record {record}"
