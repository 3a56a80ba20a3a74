"""The torchtitan HSDP pattern: FSDP2 inside a replica, ``manager.process_group()`` across.

``fully_shard`` over the ranks of this replica (the default process group); each sharded
module's all-reduce hook averages its reduced shard across replicas with
``dist.all_reduce(..., group=manager.process_group(), op=AVG)`` during the backward pass.
AdamW, a ``LambdaLR`` warm-up and ``clip_grad_norm_`` as in :mod:`ddp_train`, whose model,
optimizer and batches this uses (rank K of replica R draws ``batch(step, R, K)``). Writes
``final-r{R}-rank{K}.pt`` with this rank's local shards.

``--fault-step S`` makes rank 1 of replica 1 kill -9 itself inside its all-reduce hook at step
S, after its first cross-replica all-reduce of that step (written to ``fault.json`` first);
once per run (not again in its restart).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).parent))
import ddp_train as w  # noqa: E402

import unbroken  # noqa: E402
from unbroken import fast_exit


def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pace-s", type=float, default=0.0)
    ap.add_argument("--fault-step", type=int, default=-1)
    args = ap.parse_args()
    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        model, opt = holder["model"], holder["opt"]
        return {
            "model": {k: local(v) for k, v in model.state_dict().items()},
            "optim": {i: {k: local(v) for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())},
            "lr": [g["lr"] for g in opt.param_groups],
            "sched": holder["sched"].state_dict(),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        model, opt = holder["model"], holder["opt"]
        with torch.no_grad():
            for k, v in model.state_dict().items():
                local(v).copy_(state["model"][k])
            for i, p in enumerate(model.parameters()):
                for k, v in state["optim"][i].items():
                    if k not in opt.state[p]:
                        opt.state[p][k] = (
                            torch.distributed.tensor.DTensor.from_local(v.clone(), p.device_mesh, p.placements)
                            if k != "step"
                            else v.clone()
                        )
                    else:
                        local(opt.state[p][k]).copy_(v)
        for g, lr in zip(opt.param_groups, state["lr"], strict=False):
            g["lr"] = lr
        holder["sched"].load_state_dict(state["sched"])

    manager = unbroken.init(state_dict=state_dict, load_state_dict=load_state_dict)
    cfg = manager.config
    net = w.build_model()
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    pg = manager.process_group()
    run_dir = Path(cfg.run_dir)
    armed = cfg.replica_id == 1 and cfg.rank == 1 and args.fault_step >= 0 and not (run_dir / "fault.json").exists()
    calls = {"step": -1, "n": 0}

    def all_reduce_hook(t: torch.Tensor) -> None:
        nonlocal armed
        if armed and manager.step == args.fault_step:
            if calls["step"] == manager.step and calls["n"] >= 1:
                armed = False
                (run_dir / "fault.json").write_text(json.dumps({"step": manager.step, "all_reduces": calls["n"]}))
                os.kill(os.getpid(), signal.SIGKILL)
        calls["n"] = calls["n"] + 1 if calls["step"] == manager.step else 1
        calls["step"] = manager.step
        dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    opt, sched = w.build_optimizer(model)
    holder.update(model=model, opt=opt, sched=sched)
    manager.expect_gradients(unbroken.gradient_numel(model.parameters()))

    metrics = open(run_dir / f"metrics-r{cfg.replica_id}.jsonl", "a", buffering=1) if cfg.rank == 0 else None
    while manager.step < args.steps:
        t0 = time.perf_counter()
        step = manager.step
        manager.start_step()
        opt.zero_grad()
        x, y = w.batch(manager.step, cfg.replica_id, cfg.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.MAX_NORM)
        time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))  # paced before the exchange
        committed = manager.sync_gradients([p.grad for p in model.parameters()])
        if committed:
            opt.step()
            sched.step()
            manager.commit()
        if metrics is not None:
            d = manager.decision
            metrics.write(
                json.dumps(
                    {
                        "step": step,
                        "committed": committed,
                        "members": list(d.members) if d else [],
                        "behind": list(d.behind) if d else [],
                    }
                )
                + "\n"
            )
    torch.save({"step": manager.step, **state_dict()}, Path(cfg.run_dir) / f"final-r{cfg.replica_id}-rank{cfg.rank}.pt")
    manager.shutdown()


if __name__ == "__main__":
    fast_exit.install()
    main()
