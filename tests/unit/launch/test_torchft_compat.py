"""The ``torchft`` shim of ``unbroken run --torchft-compat``: every module torchtitan and
torchft's examples import resolves to unbroken's facade, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import unbroken
from unbroken.launch.run import torchft_compat

ROOT = Path(unbroken.__file__).resolve().parents[1]

CHECK = """
import importlib.util
import torchft, torchft.manager, torchft.process_group
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer
from torchft import ProcessGroupBabyNCCL, ProcessGroupGloo, ProcessGroupNCCL
from torchft.local_sgd import DiLoCo, LocalSGD
from torchft.optim import OptimizerWrapper
from torchft.process_group import ManagedProcessGroup
from torchft.checkpointing.pg_transport import PGTransport
from torchft.checkpointing import HTTPTransport
import unbroken.torchft
assert importlib.util.find_spec("torchft") is not None
assert torchft.manager is unbroken.torchft.manager and Manager is unbroken.torchft.Manager
assert torchft.local_sgd.DiLoCo is DiLoCo and Optimizer is OptimizerWrapper
assert PGTransport is unbroken.torchft.checkpointing.PGTransport
print("ok", torchft.__file__)
"""


def test_the_shim_makes_import_torchft_the_facade(tmp_path: Path) -> None:
    shim = torchft_compat.write_shim(tmp_path)
    assert shim == tmp_path.resolve() / "torchft-compat"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ") and str(shim) in out.stdout


def test_the_shim_goes_first_on_the_workers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert torchft_compat.python_path_with(tmp_path) == f"{tmp_path}{os.pathsep}/somewhere"
    monkeypatch.delenv("PYTHONPATH")
    assert torchft_compat.python_path_with(tmp_path) == str(tmp_path)
