"""The package as a user gets it: a built wheel, installed away from the checkout, runs the demo.

The wheel is installed with ``pip install --no-deps --target DIR`` and run with only ``DIR`` on
``PYTHONPATH`` from a directory outside the checkout, so nothing can come from the source tree;
torch and the other dependencies come from the interpreter's own environment (no download).
The optional dependencies (matplotlib, scipy, networkx) are made unimportable, as on a training
node installed without extras: the demo must not need them, and the commands that do must say
which extra to install.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# Scenarios (`make scenarios`): building and installing the wheel takes 40 s on 2 cores.
pytestmark = [pytest.mark.integration, pytest.mark.scenario, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("matplotlib", "scipy", "networkx")
# Put first on the path, this makes the extras' packages unimportable in every process of the run.
BLOCK_EXTRAS = "import sys\nfor _name in {names!r}:\n    sys.modules[_name] = None\n"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(wheel, install dir, environment) of the wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "unbroken", src / "unbroken", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        cwd=tmp,
        timeout=180,
    )
    (wheel,) = dist.glob("unbroken-*.whl")
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        cwd=tmp,
        timeout=120,
    )
    blocker = tmp / "no-extras"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_EXTRAS.format(names=EXTRAS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(target)]), "OMP_NUM_THREADS": "1"}
    return wheel, target, env


def test_wheel_metadata_names_the_license_and_keeps_extras_optional(
    installed: tuple[Path, Path, dict[str, str]],
) -> None:
    wheel, _, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = z.read(metadata).decode()
    assert "unbroken/examples/gpt/train.py" in names and "unbroken/examples/gpt/gpt_model.py" in names
    assert any(n.endswith("LICENSE") and ".dist-info/" in n for n in names)
    assert "License-Expression: BSD-3-Clause" in text
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    for module in EXTRAS:
        assert all("extra ==" in line for line in requires if line.split()[1].startswith(module)), requires


def test_installed_wheel_runs_a_short_demo(installed: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    _, target, env = installed
    where = subprocess.run(
        [sys.executable, "-c", "import unbroken.examples.gpt.train as t; print(t.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(target)  # the installed copy, not the checkout

    unbroken = [str(target / "bin" / "unbroken")]  # the console script the wheel installs
    helped = subprocess.run(
        unbroken + ["demo", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "Usage:" in helped.stdout, helped.stderr

    # A command that needs an extra says which one, instead of a ModuleNotFoundError.
    plan = subprocess.run(
        unbroken + ["plan", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert plan.returncode == 1 and "pip install 'unbroken[plan]'" in plan.stderr, plan.stderr

    # The shortest demo with a fault. Verdicts only log: this is about the package, and a false
    # hang verdict at start-up on a loaded machine would add a restart (the crash is seen by its exit).
    run_dir = tmp_path / "demo"
    proc = subprocess.Popen(
        unbroken
        + [
            "demo",
            "--steps",
            "20",
            "--fault",
            "crash:replica=1,step=6",
            "--on-verdict",
            "ignore",
            "--run-dir",
            str(run_dir),
            "--json",
        ],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["replicas_identical"] is True
    (crash,) = summary["faults"]
    assert crash["detected"] and crash["recovered"], summary["faults"]
    assert "plot left out" in Path(summary["report"]).read_text()  # no matplotlib: tables, no plots
    assert "pip install 'unbroken[report]'" in err  # and the demo said how to get them
