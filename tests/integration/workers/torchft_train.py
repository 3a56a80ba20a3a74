"""A training loop written against torchft's API only, as torchft's ``train_ddp.py`` is.

Run under ``unbroken run --torchft-compat``, where ``import torchft`` is unbroken's facade. Each
replica seeds its model differently (no shared seed: ``init_sync`` makes them identical) and
writes one metrics row per step and its final state into the run directory. ``--mode``: ``ddp``
(``torchft.DistributedDataParallel`` + ``torchft.Optimizer``), ``allreduce`` (``manager.allreduce``
per gradient, torchft's manual form) or ``diloco`` (``torchft.local_sgd.DiLoCo``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torchft
from torch import nn, optim
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.local_sgd import DiLoCo
from torchft.process_group import ManagedProcessGroup


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pace-s", type=float, default=0.05)
    ap.add_argument("--mode", choices=["ddp", "allreduce", "diloco"], default="ddp")
    args = ap.parse_args()
    replica = int(os.environ.get("UNBROKEN_REPLICA_ID", os.environ.get("REPLICA_GROUP_ID", "0")))
    run_dir = Path(os.environ.get("UNBROKEN_RUN_DIR", "."))
    torch.manual_seed(100 + replica + 7 * int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    inner = optim.AdamW(model.parameters(), lr=0.01)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica}",
        timeout=timedelta(seconds=10),
        use_async_quorum=args.mode != "diloco",
    )
    rows = open(run_dir / f"metrics-r{replica}.jsonl", "a", buffering=1)  # noqa: SIM115
    loss_fn = nn.MSELoss()
    if args.mode == "diloco":
        outer = optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, [model], inner, outer, sync_every=2):
            while manager.current_step() < args.steps:
                t0 = time.perf_counter()
                inner.zero_grad()
                x, y = batch(manager.current_step(), replica)
                loss = loss_fn(model(x), y)
                loss.backward()
                before = manager.current_step()
                inner.step()  # every second one syncs
                if manager.current_step() != before:
                    rows.write(json.dumps({"step": before, "committed": True, "loss": loss.item()}) + "\n")
                time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))
    else:
        net = DistributedDataParallel(manager, model) if args.mode == "ddp" else model
        optimizer = Optimizer(manager, inner)
        replicas_pg = ManagedProcessGroup(manager)
        while manager.current_step() < args.steps:
            t0 = time.perf_counter()
            step = manager.current_step()
            optimizer.zero_grad()
            x, y = batch(step, replica)
            loss = loss_fn(net(x), y)
            loss.backward()
            if args.mode == "allreduce":
                for p in model.parameters():
                    manager.allreduce(p.grad).wait()
            # What the replicas average, as the optimizer will see it: the same on every replica
            # of a step, a replica catching up in it too.
            grad = sum(float(p.grad.double().sum()) for p in model.parameters())
            optimizer.step()
            committed = manager.current_step() > step
            # After the step, as torchtitan logs its loss: a MAX of int64 and an AVG of a float
            # through the managed process group, outside the gradient exchange.
            top = torch.tensor([replica + 10 * step], dtype=torch.int64)
            manager.allreduce(top, reduce_op=dist.ReduceOp.MAX).wait()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, group=replicas_pg, op=dist.ReduceOp.AVG)
            rows.write(
                json.dumps(
                    {
                        "step": step,
                        "committed": committed,
                        "committed_step": manager.current_step() - 1 if committed else None,
                        "grad": grad,
                        "participants": manager.num_participants(),
                        "loss": loss.item(),
                        "max": top.item(),
                        "mean_loss": mean_loss.item(),
                        "torchft": torchft.__name__,
                    }
                )
                + "\n"
            )
            time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))
    torch.save(
        {"step": manager.current_step(), "model": model.state_dict(), "optim": inner.state_dict()},
        run_dir / f"final-r{replica}.pt",
    )
    manager.shutdown()


if __name__ == "__main__":
    main()
