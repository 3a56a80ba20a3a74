"""The torchtitan HSDP pattern: FSDP2 inside a replica, ``manager.process_group()`` across.

``fully_shard`` over the ranks of this replica (the default process group); each sharded
module's all-reduce hook averages its reduced shard across replicas with
``dist.all_reduce(..., group=manager.process_group(), op=AVG)`` during the backward pass.
AdamW, a ``LambdaLR`` warm-up and ``clip_grad_norm_`` as in :mod:`ddp_train`, whose model,
optimizer and batches this uses (rank K of replica R draws ``batch(step, R, K)``). Writes
``final-r{R}-rank{K}.pt`` with this rank's local shards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).parent))
import ddp_train as w  # noqa: E402

import unbroken  # noqa: E402


def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        model, opt = holder["model"], holder["opt"]
        return {"model": {k: local(v) for k, v in model.state_dict().items()},
                "optim": {i: {k: local(v) for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}}

    def load_state_dict(state: dict[str, Any]) -> None:
        raise RuntimeError("this worker does not catch up")

    manager = unbroken.init(state_dict=state_dict, load_state_dict=load_state_dict)
    cfg = manager.config
    net = w.build_model()
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    pg = manager.process_group()

    def all_reduce_hook(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    opt, sched = w.build_optimizer(model)
    holder.update(model=model, opt=opt)
    manager.expect_gradients(unbroken.gradient_numel(model.parameters()))

    while manager.step < args.steps:
        manager.start_step()
        opt.zero_grad()
        x, y = w.batch(manager.step, cfg.replica_id, cfg.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.MAX_NORM)
        if manager.sync_gradients([p.grad for p in model.parameters()]):
            opt.step()
            sched.step()
            manager.commit()
    torch.save({"step": manager.step, **state_dict()}, Path(cfg.run_dir) / f"final-r{cfg.replica_id}-rank{cfg.rank}.pt")
    manager.shutdown()


if __name__ == "__main__":
    main()
