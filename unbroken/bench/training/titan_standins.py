"""torchtitan 0.3.0's own training entry point on CPU: every stand-in in this one file.

torchtitan's ``FaultTolerantTrainer`` (``--module torchft.llama3``) targets GPUs; nothing of
torchtitan or torchft is edited, and this wrapper changes only what a CPU cannot run, each
stand-in listed in ``STANDINS`` with why, before it calls ``torchtitan.train.main()`` with the
command line it was given. A replica group started by ``unbroken run`` learns its number from
``UNBROKEN_REPLICA_ID``: the wrapper appends ``--fault_tolerance.replica_id=<it>`` unless the
command line has one, as a user's per-group launch line would. After training it writes
``final-r<replica>.pt`` (the step and the model's full tensors) into ``UNBROKEN_RUN_DIR`` so
the test can compare replicas; that is observation, not a stand-in. Launched as a torchft user
does (``REPLICA_GROUP_ID`` beside a lighthouse), it serves ``unbroken bench torchtitan``'s torchft
side the same way.

Usage: ``unbroken run --torchft-compat --replicas 3 -- python titan_standins.py
--module torchft.llama3 --config llama3_torchft_debugmodel --fault_tolerance.enable ...``.
``make_assets(dir)`` writes the tokenizer and the ``c4_test`` data the debug config names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

STANDINS = {
    "device": "torchtitan picks `cuda` when no accelerator is found: use torch.cpu (set_device, "
    "synchronize, current_device are CPU no-ops there)",
    "triton": "models.common.moe imports minimal_async_ep.kernels, which `import triton` (absent "
    "on CPU): a module whose kernels raise if called; llama3 has no MoE and never calls them",
    "memory_monitor": "DeviceMemoryMonitor reads torch.cuda memory statistics: zeros on CPU",
    "sdpa": "FlexAttention has no CPU backward in torch 2.13: causal SDPA over the sequence "
    "(one document per sample in the data the test writes, so the masks agree)",
    "barrier": "set_pg_timeouts calls barrier(device_ids=[...]), which gloo refuses: a plain barrier",
    "set_timeout": "set_pg_timeouts calls torch.distributed.set_timeout, newer than torch 2.13 (not "
    "a CPU matter): torch 2.13's own _set_pg_timeout(timeout, group)",
}


def make_assets(root: Path, docs: int = 400) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer (vocab < the debug model's 2048) and a ``c4_test``-shaped
    json dataset, both made from text written here: neither is in torchtitan's wheel."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the model trains on through a failure and the group rejoins from a peer".split()
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 30)) for i in range(docs)]
    data = root / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    cfg = {"bos_token": special[0], "eos_token": special[1], "add_bos_token": True, "add_eos_token": True}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok_dir, data


def install() -> None:
    """Apply every stand-in of ``STANDINS``, before torchtitan's modules import each other."""
    import types

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")  # STANDINS["triton"]

    def no_kernel(name: str) -> Any:
        if not name.endswith("_kernel"):
            raise AttributeError(name)

        def call(*a: Any, **kw: Any) -> Any:
            raise RuntimeError(f"{name} is a triton kernel: not on CPU")

        return call

    kernels.__getattr__ = no_kernel  # type: ignore[method-assign]
    sys.modules[kernels.__name__] = kernels

    import torchtitan.tools.utils as tutils

    tutils.device_type, tutils.device_module = "cpu", torch.cpu  # STANDINS["device"]

    import torchtitan.components.metrics as metrics

    class CpuMemoryMonitor:  # STANDINS["memory_monitor"]
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor

    from torchtitan.models.common import attention

    def causal_sdpa(  # FlexAttention.forward's parameter names: parallelize() reads them
        self: Any, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(  # STANDINS["sdpa"]
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            scale=kw.get("scale"),
            is_causal=True,
            enable_gqa=kw.get("enable_gqa", False),
        )
        return out.transpose(1, 2)

    attention.FlexAttention.forward = causal_sdpa

    import torch.distributed as dist

    plain_barrier = dist.barrier

    def barrier(*args: Any, device_ids: Any = None, **kw: Any) -> Any:  # STANDINS["barrier"]
        return plain_barrier(*args, **kw)

    dist.barrier = barrier
    if not hasattr(dist, "set_timeout"):  # STANDINS["set_timeout"]
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]


def main() -> None:
    # Run as a script, this file's folder (unbroken/bench) comes first on sys.path: its modules
    # must not stand in for top-level ones of the same name.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != here]
    if sys.argv[1:2] == ["--make-assets"]:
        make_assets(Path(sys.argv[2]))
        return
    install()
    if sys.argv[1:2] == ["--steps"]:  # the test harness's Job puts --steps N first
        sys.argv[1:3] = ["--training.steps", sys.argv[2]]
    from unbroken.config import global_rank, observation_dir, replica_group

    replica = replica_group()  # unbroken run's UNBROKEN_REPLICA_ID, or a torchft line's REPLICA_GROUP_ID
    if replica is not None and not any(a.startswith("--fault_tolerance.replica_id") for a in sys.argv):
        sys.argv.append(f"--fault_tolerance.replica_id={replica}")
    from torchtitan import train
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    trained = FaultTolerantTrainer.train

    def train_and_record(self: Any) -> Any:
        out = trained(self)
        run_dir = observation_dir()
        if run_dir and global_rank() == 0:
            sd = {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in self.model_parts[0].state_dict().items()
            }
            step = self.ft_manager.manager.current_step() if self.ft_manager.manager else self.step
            torch.save({"step": step, "model": sd}, Path(run_dir) / f"final-r{replica}.pt")
        return out

    FaultTolerantTrainer.train = train_and_record
    train.main()


if __name__ == "__main__":
    main()
