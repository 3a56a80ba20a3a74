"""A replica group of several ranks that shards its model with FSDP2 (HSDP-style training).

Inside a replica, FSDP2 reduce-scatters gradients over the replica's own ranks; across
replicas, ``unbroken.average_gradients`` exchanges each rank's local shard with the same
shard of the other replicas. Writes ``metrics-r{R}.jsonl`` (rank 0) and one final state per
rank, ``final-r{R}-rank{K}.pt``, holding that rank's local shards.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken


def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pace-s", type=float, default=0.2,
                    help="Each step lasts at least this long (stands in for real compute), so a restarted "
                         "replica has steps left to join.")
    ap.add_argument("--restarted-first-step-s", type=float, default=0.0,
                    help="A restarted process's first step lasts at least this long (a cold start: "
                         "allocator warm-up, kernel autotuning), which its peers should not wait for.")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="Steps between checkpoints when the job has a checkpoint directory (0: only on SIGTERM).")
    args = ap.parse_args()

    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        model, opt = holder["model"], holder["opt"]
        return {
            "model": {k: local(v) for k, v in model.state_dict().items()},
            "optim": {i: {k: local(v) for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())},
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        model, opt = holder["model"], holder["opt"]
        with torch.no_grad():
            for k, v in model.state_dict().items():
                local(v).copy_(state["model"][k])
            for i, p in enumerate(model.parameters()):
                for k, v in state["optim"][i].items():
                    if k not in opt.state[p]:
                        opt.state[p][k] = torch.distributed.tensor.DTensor.from_local(
                            v.clone(), p.device_mesh, p.placements) if hasattr(p, "device_mesh") else v.clone()
                    else:
                        local(opt.state[p][k]).copy_(v)

    manager = unbroken.init(state_dict=state_dict, load_state_dict=load_state_dict)
    cfg = manager.config
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    model = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    holder.update(model=model, opt=opt)
    manager.expect_gradients(unbroken.gradient_numel(model.parameters()))
    checkpointer = unbroken.checkpointer_for(manager)  # None unless `unbroken run --checkpoint-dir`
    unbroken.resume(manager, checkpointer)
    first_step_s = args.restarted_first_step_s if cfg.restart_count > 0 else 0.0

    run_dir = Path(cfg.run_dir)
    metrics = open(run_dir / f"metrics-r{cfg.replica_id}.jsonl", "a", buffering=1) if cfg.rank == 0 else None
    while manager.step < args.steps:
        t0 = time.perf_counter()
        manager.start_step()
        opt.zero_grad()
        g = torch.Generator().manual_seed(manager.step * 101 + cfg.replica_id * 7 + cfg.rank)
        x = torch.randn(8, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
        loss.backward()
        time.sleep(max(0.0, max(args.pace_s, first_step_s) - (time.perf_counter() - t0)))
        first_step_s = 0.0
        step = manager.step
        committed = unbroken.average_gradients(manager, model.parameters())
        if committed:
            opt.step()
            manager.commit()
            unbroken.save_if_due(manager, checkpointer, args.checkpoint_every)
        if metrics is not None:
            d = manager.decision
            metrics.write(json.dumps({"step": step if not committed else manager.step - 1, "loss": loss.item(),
                                      "committed": committed, "members": list(d.members) if d else [],
                                      "behind": list(d.behind) if d else [], "step_s": time.perf_counter() - t0,
                                      "t": time.time()}) + "\n")
    torch.save({"step": manager.step, **state_dict()}, run_dir / f"final-r{cfg.replica_id}-rank{cfg.rank}.pt")
    manager.shutdown()


if __name__ == "__main__":
    main()
