"""The example Llama (``transformers``, FSDP2 over 2 ranks per replica, the cross-replica average in
FSDP2's all-reduce hook) as a real job: a rank killed inside the hook takes its replica group down,
the group restarts and catches up, and both replicas end bitwise identical; checkpoints go both
ways between unbroken and plain ``torch.distributed.checkpoint``.

Each job starts 4 processes that import torch and transformers (about 30 s on a busy 2-core
machine), so the suite runs one job; SIGSTOP, a coordinator restart and the loss against a
fault-free run are in scenario tests below (``make scenarios``) and in
``unbroken bench recovery --model llama``.

Loss tolerance (heavy tests): under ``constant_global_batch`` a run with faults trains the same
samples in the same steps as a fault-free run and differs only by floating-point summation order
(and the catch-up step's clipping of the local gradient, see the example), so the mean loss of the
last 5 steps must be within 0.05 nats of the fault-free run's; a diverged or corrupted run is off by
far more (the loss starts at ln(2048) = 7.6).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch

from tests.integration.harness import ROOT, Job, metrics, python_env
from unbroken.examples.llama.llama_model import LlamaSize

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
SCRIPT = ROOT / "examples" / "llama" / "train.py"
SMALL = ["--samples-per-replica", "4", "--seq-len", "64"]
CALM = ["--ranks-per-replica", "2", "--min-replicas", "1", "--on-verdict", "ignore"]
heavy = pytest.mark.scenario  # minutes on 2 cores: `make scenarios` runs them


def llama_shapes(size: LlamaSize) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes of ``transformers``' LlamaForCausalLM at ``size``."""
    h, v, i = size.hidden_size, size.vocab_size, size.intermediate_size
    kv = size.num_key_value_heads * (h // size.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(size.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def plain_dcp_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Initial weights written by plain DCP (FileSystemWriter, one process, no unbroken)."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(5)
    weights = {
        k: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else 1.0 + 0.1 * torch.randn(s, generator=g))
        for k, s in llama_shapes(LlamaSize()).items()
    }
    dcp.save({"model": weights}, checkpoint_id=path)
    return weights


def plain_dcp_load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, loaded whole at 1 rank by plain ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=path)
    return state


def digests(run_dir: Path, replica: int) -> list[dict]:
    return [json.loads((run_dir / f"digest-r{replica}-rank{k}.json").read_text()) for k in (0, 1)]


def assert_replicas_identical(run_dir: Path, steps: int) -> None:
    a, b = digests(run_dir, 0), digests(run_dir, 1)
    assert [d["step"] for d in a + b] == [steps] * 4
    assert a == b, "the replicas' shards differ"
    assert a[0]["digest"] != a[1]["digest"], "the ranks should hold different shards"


@pytest.mark.scenario
def test_llama_kill_9_of_one_rank_and_dcp_both_ways(tmp_path: Path) -> None:
    steps = 40
    initial = plain_dcp_checkpoint(tmp_path / "plain")
    run_dir, dcp_dir = tmp_path / "run", tmp_path / "dcp"
    with Job(
        run_dir,
        replicas=2,
        steps=steps,
        script=SCRIPT,
        extra=CALM,
        train_args=[
            *SMALL,
            "--pace-s",
            "0.6",
            "--fault-step",
            "3",
            "--init-dcp",
            str(tmp_path / "plain"),
            "--dcp-dir",
            str(dcp_dir),
            "--dcp-every",
            str(steps),
            "--save-final",
        ],
    ) as job:
        assert job.wait(400) == 0
    fault = json.loads((run_dir / "fault.json").read_text())
    assert fault["step"] == 3
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums), "replica 0 never trained alone"
    assert any(q["behind"] == [1] for q in quorums), "the restarted replica group never caught up"
    assert_replicas_identical(run_dir, steps)
    rows = [r for r in metrics(run_dir, 0) if r.get("committed")]
    assert [r["step"] for r in rows] == list(range(steps))
    assert rows[-1]["samples_skipped"] == rows[-1]["samples_repeated"] == 0
    assert any(len(r["slots"]) == 2 for r in rows), "replica 0 never took over replica 1's samples"

    # Plain DCP in: the job started from the weights plain DCP wrote (saved again, as step 0, by DCPWriter).
    started = plain_dcp_load(dcp_dir / "step-00000000")
    assert started.keys() == {f"model.{k}" for k in initial}
    for k, v in initial.items():
        assert torch.equal(started[f"model.{k}"], v), k
    # DCPWriter out: the final checkpoint of the 2-rank replica, loaded whole at 1 rank, is the job's state.
    final = plain_dcp_load(dcp_dir / f"step-{steps:08d}")
    shards = [torch.load(run_dir / f"final-r0-rank{k}.pt", weights_only=False) for k in (0, 1)]
    for name in initial:
        assert torch.equal(final[f"model.{name}"], torch.cat([s["model"][name] for s in shards])), name
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.cat([s["optim"][name][key] for s in shards])
            assert torch.equal(final[f"optim.state.{name}.{key}"], whole), (name, key)


def tail_loss(run_dir: Path) -> float:
    rows = [r for r in metrics(run_dir, 0) if r.get("committed")]
    return statistics.mean(r["loss"] for r in rows[-5:])


@pytest.fixture(scope="module")
def clean_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    with Job(
        run_dir, replicas=2, steps=HEAVY_STEPS, script=SCRIPT, extra=CALM, train_args=[*SMALL, "--pace-s", "0.6"]
    ) as job:
        assert job.wait(400) == 0
    assert_replicas_identical(run_dir, HEAVY_STEPS)
    return tail_loss(run_dir)


HEAVY_STEPS = 50


@heavy
def test_llama_sigstop_of_a_replica(tmp_path: Path, clean_loss: float) -> None:
    run_dir = tmp_path / "run"
    with Job(
        run_dir,
        replicas=2,
        steps=HEAVY_STEPS,
        script=SCRIPT,
        extra=[*CALM, "--on-hang", "wait"],
        train_args=[*SMALL, "--pace-s", "0.6"],
    ) as job:
        job.wait_for_step(1, 8, timeout=200)
        pid = [e["pid"] for e in job.events("process_started") if e["replica"] == 1 and e["rank"] == 0][-1]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = job.metrics(0)[-1]["step"]
        job.wait_for_step(0, stopped_at + 8, timeout=120)
        os.kill(pid, signal.SIGCONT)
        assert job.wait(400) == 0
    quorums = job.events("quorum")
    assert any(q["members"] == [0] for q in quorums) and any(q["behind"] == [1] for q in quorums)
    assert_replicas_identical(run_dir, HEAVY_STEPS)
    assert abs(tail_loss(run_dir) - clean_loss) < 0.05


@heavy
def test_llama_coordinator_restart(tmp_path: Path, clean_loss: float) -> None:
    """The job's coordinator runs apart (``unbroken coordinator``) and is kill -9-ed mid-run."""
    import subprocess
    import sys

    from unbroken.launch.run.launcher import free_port

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()

    def coordinator() -> subprocess.Popen[bytes]:
        with open(tmp_path / "coordinator.log", "ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "unbroken",
                    "coordinator",
                    "--replicas",
                    "2",
                    "--min-replicas",
                    "1",
                    "--port",
                    str(port),
                    "--state-dir",
                    str(tmp_path / "coord"),
                    "--startup-window",
                    "60",
                ],
                env=python_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    coord = coordinator()
    try:
        with Job(
            run_dir,
            replicas=2,
            steps=HEAVY_STEPS,
            script=SCRIPT,
            coordinator=f"127.0.0.1:{port}",
            extra=CALM,
            train_args=[*SMALL, "--pace-s", "0.6"],
        ) as job:
            job.wait_for_step(0, 10, timeout=200)
            coord.kill()
            coord.wait()
            time.sleep(0.5)
            coord = coordinator()
            assert job.wait(400) == 0
    finally:
        if coord.poll() is None:
            os.killpg(coord.pid, signal.SIGKILL)
            coord.wait()
    assert_replicas_identical(run_dir, HEAVY_STEPS)
    epochs = [r["epoch"] for r in metrics(run_dir, 0) if r.get("epoch") is not None]
    assert epochs == sorted(epochs), "epochs must never go back across the restart"
    # The restarted coordinator continued the epoch the job trained in: no group was rebuilt for it.
    told = [json.loads(line) for line in (tmp_path / "coord" / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in told if e["kind"] == "epoch_resumed"]
    assert len(resumed) == 1 and resumed[0]["epoch"] in epochs, resumed
    assert not [e for e in told if e["kind"] == "resume_given_up"]
    assert abs(tail_loss(run_dir) - clean_loss) < 0.05


@heavy
def test_llama_demo_survives_a_crash_a_bit_flip_and_a_hang(tmp_path: Path) -> None:
    """``unbroken demo --model llama``: the demo's story on 3 replicas x 2 FSDP2 ranks. The bit
    flip lands in one rank's sum inside FSDP2's all-reduce hook, where the fingerprint swap
    starts as the last bucket comes in: caught, named and healed there too."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "unbroken", "demo", "--model", "llama", "--steps", "60", "--json"]
    cmd += ["--run-dir", str(tmp_path / "run"), "--fault", "crash:replica=1,rank=1,step=15"]
    cmd += ["--fault", "bitflip:replica=0,rank=1,step=27,where=result,bit=30"]
    cmd += ["--fault", "hang:replica=2,step=35"]
    done = subprocess.run(cmd, env=python_env(), capture_output=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["model"] == "llama" and summary["steps"] == 60
    assert summary["replicas_identical"] is True
    assert [f["kind"] for f in summary["faults"]] == ["crash", "bitflip", "hang"], summary["faults"]
    for fault in summary["faults"]:
        assert fault["detected"] and fault["attributed_correctly"] and fault["recovered"], fault
    rows = metrics(tmp_path / "run", 0)
    assert rows[-1]["early_swaps"] > 40, rows[-1]  # the swap began at the last bucket in most steps
    assert summary["checkpoints_on_disk"][0] == 60


@heavy
def test_llama_plain_and_unbroken_steps_alternate_in_one_job(tmp_path: Path) -> None:
    """``--plain-alternate`` (what ``bench recovery --alternate-steps`` times): blocks of plain
    HSDP steps over a static Gloo group between blocks of unbroken's steps; the replicas stay
    identical through both, and every step's record says which it was."""
    run_dir = tmp_path / "run"
    with Job(
        run_dir, replicas=2, steps=20, script=SCRIPT, extra=CALM, train_args=[*SMALL, "--plain-alternate", "5"]
    ) as job:
        assert job.wait(400) == 0
    rows = [r for r in metrics(run_dir, 0) if "step" in r]
    assert [r["step"] for r in rows] == list(range(20))
    assert [r["unbroken"] for r in rows] == ([False] * 5 + [True] * 5) * 2
    assert [r["unbroken_step"] for r in rows if r["unbroken"]] == list(range(10))
    assert_replicas_identical(run_dir, 10)  # unbroken's step count moved in its blocks only
