"""A replica group of several ranks that shards its model with FSDP2 (HSDP-style training).

Inside a replica, FSDP2 reduce-scatters gradients over the replica's own ranks; across
replicas, ``unbroken.average_gradients`` exchanges each rank's local shard with the same
shard of the other replicas. The state is ``unbroken.model_state``: FSDP2's DTensors, with no
hand-made shards. Writes ``metrics-r{R}.jsonl`` (rank 0) and one final state per rank,
``final-r{R}-rank{K}.pt``, holding that rank's local shards.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken
from unbroken import fast_exit
from unbroken.train.state import as_local


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--pace-s",
        type=float,
        default=0.2,
        help="Each step lasts at least this long (stands in for real compute), so a restarted "
        "replica has steps left to join.",
    )
    ap.add_argument(
        "--restarted-first-step-s",
        type=float,
        default=0.0,
        help="A restarted process's first step lasts at least this long (a cold start: "
        "allocator warm-up, kernel autotuning), which its peers should not wait for.",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="Steps between checkpoints when the job has a checkpoint directory (0: only on SIGTERM).",
    )
    args = ap.parse_args()

    with unbroken.init() as manager:
        cfg = manager.config
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        mesh = init_device_mesh("cpu", (cfg.world_size,))
        model = fully_shard(net, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # DTensor state: sent to a peer as this rank's local shards and wrapped back on load.
        state = unbroken.model_state(model, opt)
        manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
        manager.expect_gradients(unbroken.gradient_numel(model.parameters()))
        train(args, manager, model, opt, state)


def train(
    args: argparse.Namespace,
    manager: unbroken.Manager,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    state: unbroken.ModelState,
) -> None:
    cfg = manager.config
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
            metrics.write(
                json.dumps(
                    {
                        "step": step if not committed else manager.step - 1,
                        "loss": loss.item(),
                        "committed": committed,
                        "members": list(d.members) if d else [],
                        "behind": list(d.behind) if d else [],
                        "step_s": time.perf_counter() - t0,
                        "t": time.time(),
                    }
                )
                + "\n"
            )
    final = as_local(state.state_dict())  # this rank's local shards, keyed by parameter name
    torch.save(
        {"step": manager.step, "model": final["model"], "optim": final["optim"]["state"]},
        run_dir / f"final-r{cfg.replica_id}-rank{cfg.rank}.pt",
    )


if __name__ == "__main__":
    fast_exit.install()
    main()
