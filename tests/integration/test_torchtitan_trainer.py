"""torchtitan 0.3.0's ``FaultTolerantTrainer`` itself, unmodified, on unbroken through a ``kill -9``.

Each replica group runs torchtitan's own entry point (``torchtitan.train.main``) with the llama3
debug model of ``--module torchft.llama3 --config llama3_torchft_debugmodel`` and per-step HSDP
(``--fault_tolerance.semi_sync_method None --fault_tolerance.process_group gloo
--checkpoint.enable``), behind the CPU stand-ins of unbroken/bench/training/titan_standins.py (one file, each
stand-in listed with why). The tokenizer and the ``c4_test`` data are made here. Needs ``make
torchft-upstream`` (the torchtitan wheel unpacked into ``.cache/upstream``), and ``datasets``,
``tokenizers`` and ``tensorboard``, which torchtitan's modules import.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import ROOT, Job

pytestmark = [pytest.mark.integration]

UPSTREAM = ROOT / ".cache" / "upstream"
WRAPPER = ROOT / "unbroken" / "bench" / "training" / "titan_standins.py"
STEP = re.compile(r"step:\s+(\d+)")


def titan_args(assets: Path, dump: Path, replicas: int) -> list[str]:
    return [
        *("--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel"),
        "--fault_tolerance.enable",
        f"--fault_tolerance.group_size={replicas}",
        *("--fault_tolerance.semi_sync_method", "None", "--fault_tolerance.process_group", "gloo"),
        "--checkpoint.enable",
        *("--checkpoint.interval", "1000"),  # only the last step saves: a restart starts afresh and heals
        *("--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "c4_test")),
        *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        *("--profiler.no-enable-profiling", "--validator.no-enable", "--dump_folder", str(dump)),
    ]


def logged_steps(run_dir: Path, replica: int) -> list[int]:
    path = run_dir / "logs" / f"replica{replica}-rank0.log"
    return [int(m) for m in STEP.findall(path.read_text(errors="replace"))] if path.exists() else []


def test_fault_tolerant_trainer_survives_kill_9(tmp_path: Path) -> None:
    if not (UPSTREAM / "torchtitan" / "experiments" / "torchft" / "trainer.py").exists():
        pytest.skip(f"torchtitan's wheel is not unpacked at {UPSTREAM}: run `make torchft-upstream`")
    for mod in ("tyro", "datasets", "tokenizers", "tensorboard"):
        pytest.importorskip(mod, reason=f"torchtitan's modules import {mod}: not installed")
    from unbroken.bench.training.titan_standins import make_assets

    make_assets(tmp_path / "assets")
    replicas, steps, at = 3, 40, 5
    run_dir = tmp_path / "run"
    path = os.pathsep.join(filter(None, [str(ROOT), str(UPSTREAM), os.environ.get("PYTHONPATH", "")]))
    with Job(
        run_dir,
        replicas=replicas,
        steps=steps,
        script=WRAPPER,
        extra=["--torchft-compat", "--min-replicas", "1"],
        train_args=titan_args(tmp_path / "assets", tmp_path / "dump", replicas),
        env={"PYTHONPATH": path},
    ) as job:
        deadline = time.monotonic() + 300
        while not any(s >= at for s in logged_steps(run_dir, 1)):
            assert time.monotonic() < deadline and job.proc.poll() is None, "replica 1 never reached step 5"
            time.sleep(0.2)
        os.kill(job.pid(1), signal.SIGKILL)
        assert job.wait(600) == 0
        states = job.final_states()
    assert sorted(states) == list(range(replicas))
    # torchtitan counts its steps, the manager the committed ones: a step the kill failed is not
    committed = {r: s["step"] for r, s in states.items()}
    assert len(set(committed.values())) == 1 and committed[0] >= steps - 5, committed
    for r in range(1, replicas):
        for k, v in states[0]["model"].items():
            assert torch.equal(v, states[r]["model"][k]), (r, k)
    assert any(e["replica"] == 1 for e in job.events("caught_up")), "the restarted replica never caught up"
