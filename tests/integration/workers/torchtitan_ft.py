"""torchtitan 0.3.0's fault-tolerance glue, unmodified, on unbroken's facade.

``TorchFTManager`` (``torchtitan/experiments/torchft/manager.py``) builds ``torchft.Manager``,
registers its ``ManagedProcessGroup`` as ``dp_replicate`` and puts FSDP2's all-reduce hook on
it; the loss is logged as torchtitan's trainer does (``dist_utils.dist_sum``/``dist_max`` with
the manager's ``loss_sync_pg``: functional collectives, a float and an int64). The model is a
small FSDP2 MLP instead of the Llama debug model; each replica seeds it differently.
Usage: ``unbroken run --torchft-compat -- python torchtitan_ft.py --steps N --pace-s S``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchft
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint_utils import init_optim_state
from torchtitan.distributed import utils as dist_utils
from torchtitan.experiments.torchft.manager import TorchFTManager


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pace-s", type=float, default=0.1)
    args = ap.parse_args()
    steps, pace_s = args.steps, args.pace_s
    replica = int(os.environ["UNBROKEN_REPLICA_ID"])
    run_dir = Path(os.environ["UNBROKEN_RUN_DIR"])
    dist.init_process_group("gloo")  # as torchtitan's init_distributed does (env://)
    ftm = TorchFTManager(
        TorchFTManager.Config(enable=True, process_group="gloo", replica_id=replica, group_size=2, min_replica_size=1)
    )
    torch.manual_seed(replica)  # no shared seed: init_sync
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model)
    ftm.maybe_set_all_reduce_hook([model])
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    init_optim_state(inner)  # as TorchFTOptimizersContainer does: the state exists before step 1
    opt = torchft.Optimizer(ftm.manager, inner)
    ftm.manager.set_state_dict_fns(
        lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    )
    rows = open(run_dir / f"metrics-r{replica}.jsonl", "a", buffering=1)  # noqa: SIM115
    seen = 0
    while ftm.manager.current_step() < steps:
        t0 = time.perf_counter()
        step = ftm.manager.current_step()
        g = torch.Generator().manual_seed(100 * step + replica)
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        seen += x.shape[0]
        pg = ftm.loss_sync_pg
        avg = dist_utils.dist_sum(loss.detach(), None, pg)
        top = dist_utils.dist_max(loss.detach(), None, pg)
        tokens = dist_utils.dist_sum(torch.tensor(seen, dtype=torch.int64), None, pg)
        committed = ftm.manager.current_step() > step
        row = {"step": ftm.manager.current_step() - 1 if committed else step, "committed": committed}
        rows.write(json.dumps({**row, "loss": loss.item(), "sum": avg, "max": top, "tokens": tokens}) + "\n")
        time.sleep(max(0.0, pace_s - (time.perf_counter() - t0)))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    torch.save({"step": ftm.manager.current_step(), "model": state}, run_dir / f"final-r{replica}.pt")
    ftm.manager.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
