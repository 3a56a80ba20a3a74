"""The GPU path: CUDA state through checkpoints and catch-up, the Llama example on CUDA through a
kill -9 and a SIGSTOP, the commit vote on NCCL, the duplicate-GPU stop, memory-flat epochs.

Marked ``gpu`` and skipped, with the reason, where CUDA is absent (CI); ``make test-gpu`` runs
them on a GPU machine. They are written for one GPU, the machine the project is checked on: one
device allows one NCCL rank, so replicas sharing it exchange over Gloo (``auto``) and the NCCL
paths are exercised with one-rank groups.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration.harness import ROOT, Job, metrics
from unbroken.bench.control_plane.epochs import churn
from unbroken.checkpoint import Checkpointer
from unbroken.comm.catchup import CatchupServer, fetch_state, take_snapshot
from unbroken.control.quorum.job_health import EXIT_CONFIG
from unbroken.train.step.vote import vote_device
from unbroken.wire.auth import JobSecret

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine"),
]
LLAMA = ROOT / "examples" / "llama" / "train.py"
SECRET = JobSecret.generate()


def cuda_state(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(2048, 1024, device="cuda", generator=g),
            "h": torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16),
        },
        "optim": {"step": 7, "exp_avg": torch.randn(2048, 1024, device="cuda", generator=g)},
    }


def test_a_checkpoint_of_cuda_state_restores_to_the_device_bitwise(tmp_path: Path) -> None:
    state = cuda_state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(3, state)
        state["model"]["w"].add_(1.0)  # training goes on after the snapshot
        ck.wait()
        into = cuda_state(seed=1)
        target = into["model"]["w"]
        restored = ck.load_latest(into=into)
    assert restored.source == "memory" and restored.step == 3
    got = restored.state["model"]
    assert got["w"] is target and got["w"].is_cuda, "restored into the device tensor given"
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    with Checkpointer(str(tmp_path)) as ck:  # a fresh process: from disk, into device memory
        from_disk = ck.load_latest(into=cuda_state(seed=2))
    assert from_disk.source == "disk" and from_disk.state["model"]["w"].is_cuda
    assert all(torch.equal(from_disk.state["model"][k], v) for k, v in expected.items())


def test_catch_up_of_cuda_state_from_a_donor_is_bitwise() -> None:
    donor = cuda_state()
    expected = {k: v.clone() for k, v in donor["model"].items()}
    server = CatchupServer(SECRET)
    try:
        server.publish(take_snapshot(5, donor, server.pool))
        donor["model"]["w"].mul_(2.0)  # the donor trains on
        mine = cuda_state(seed=9)
        target = mine["model"]["w"]
        got = fetch_state(server.address, 5, SECRET, into=mine)
    finally:
        server.close()
    assert got["model"]["w"] is target and target.is_cuda
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    assert got["optim"]["step"] == 7


def test_the_commit_vote_runs_on_cuda_tensors_over_nccl(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        device = vote_device(dist.get_backend())
        assert device.type == "cuda"
        for ok, want in ((1, True), (0, False)):
            flag = torch.tensor([ok], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            assert bool(flag.item()) is want
    finally:
        dist.destroy_process_group()


def test_the_llama_example_on_cuda_survives_kill_9_and_sigstop_with_identical_replicas(tmp_path: Path) -> None:
    """Three replicas of one rank on one GPU: no flag needed (``auto`` picks Gloo for the shared
    GPU); a replica killed, another stopped and resumed; every replica ends bitwise identical and
    no sample is skipped or repeated."""
    steps = 60
    run_dir = tmp_path / "run"
    extra = ["--min-replicas", "1", "--on-verdict", "ignore", "--on-hang", "wait", "--fault", "crash:replica=1,step=10"]
    args = ["--device", "cuda", "--samples-per-replica", "4", "--seq-len", "64", "--pace-s", "0.2", "--save-final"]
    with Job(run_dir, replicas=3, steps=steps, script=LLAMA, extra=extra, train_args=args) as job:
        job.wait_for_step(2, 25, timeout=300)
        pid = [e["pid"] for e in job.events("process_started") if e["replica"] == 2][-1]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(5)
        os.kill(pid, signal.SIGCONT)
        assert job.wait(600) == 0
    quorums = job.events("quorum")
    assert any(1 in q["behind"] for q in quorums), "the killed replica never caught up"
    assert not job.events("job_failed")
    digests = [json.loads((run_dir / f"digest-r{r}-rank0.json").read_text()) for r in range(3)]
    assert [d["step"] for d in digests] == [steps] * 3
    assert len({d["digest"] for d in digests}) == 1, digests
    rows = [r for r in metrics(run_dir, 0) if r.get("committed")]
    assert [r["step"] for r in rows] == list(range(steps))
    assert rows[-1]["samples_skipped"] == rows[-1]["samples_repeated"] == 0


def test_nccl_forced_on_one_shared_gpu_stops_the_job_with_the_hint(tmp_path: Path) -> None:
    args = ["--device", "cuda", "--samples-per-replica", "2", "--seq-len", "32"]
    extra = ["--cross-replica-backend", "nccl", "--min-replicas", "1"]
    started = time.monotonic()
    with Job(tmp_path / "run", replicas=2, steps=20, script=LLAMA, extra=extra, train_args=args) as job:
        code = job.wait(300)
        failed = [e for e in job.events("job_failed") if e["source"] == "coordinator"]
        epochs = job.events("quorum")
    assert code == EXIT_CONFIG
    assert len(failed) == 1 and failed[0]["cause"] == "configuration"
    assert "--cross-replica-backend gloo" in failed[0]["hint"]
    assert len([q for q in epochs if q["t"] <= failed[0]["t"]]) <= 3
    print(f"stopped in {failed[0]['t'] - min(q['t'] for q in epochs):.1f}s, {time.monotonic() - started:.0f}s in all")


def test_nccl_groups_built_and_aborted_for_100_epochs_leave_gpu_memory_flat() -> None:
    """100 epochs: an NCCL abort takes about a second on an H200 (torch 2.11), and a build waits
    for all but one retired communicator to be aborted, so these epochs run at about one a second."""
    run = churn(epochs=100, size=2, abort_every=5, device="cuda", timeout_s=300)
    report, drift = run["reports"][0], run["drift"][0]
    print(json.dumps(report["rows"]), "abort ms median", run["abort_ms_median"], "max", run["abort_ms_max"])
    assert drift["gpu_used_mib"] <= 64, drift
    assert drift["threads"] <= 2 and drift["rss_mib"] <= 256, drift
    assert report["aborted"] >= 98 and report["stuck"] == 0, report
