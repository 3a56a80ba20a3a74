"""A small MLP trained from :class:`unbroken.train.data.ReplicaBatches`: which samples each replica
consumed at each committed step.

Sample ``i`` is ``x = randn(IN)`` seeded by ``i`` and ``y = tanh(x @ W)`` for a fixed ``W``, so a
test can recompute the fault-free run in one process from the ids alone. ``unbroken.Optimizer``
over SGD with momentum; each slot of a step is one micro-batch whose mean loss is scaled by the
plan's ``loss_scale``. After each committed step the worker appends
``{"step", "ids", "members", "behind", "account"}`` to ``metrics-r{R}.jsonl``; at the end it
writes ``final-r{R}.pt``.

``--kill-step S`` / ``--stop-step S``: replica 1 kill -9s itself (replica 2 SIGSTOPs itself) at
step S after its batches are planned and before its exchange; it first writes
``fault-r{R}.json`` with its pid. Once per run (not again after a restart).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import unbroken
from unbroken import fast_exit
from unbroken.train.data import ReplicaBatches

IN, HIDDEN, OUT = 16, 32, 4
PER_REPLICA = 8


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def samples(ids: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.Generator().manual_seed(99)
    weight = torch.randn(IN, OUT, generator=w)
    xs = torch.stack([torch.randn(IN, generator=torch.Generator().manual_seed(i)) for i in ids])
    return xs, torch.tanh(xs @ weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pace-s", type=float, default=0.0)
    ap.add_argument("--policy", default="constant_global_batch")
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    args = ap.parse_args()

    with unbroken.init() as manager:
        cfg = manager.config
        net = build_model()
        opt = unbroken.Optimizer(build_optimizer(net), manager)
        batches = ReplicaBatches(manager, PER_REPLICA, args.policy)
        manager.register_state_dict_fn("model", net.load_state_dict, net.state_dict)
        manager.register_state_dict_fn("optim", opt.load_state_dict, opt.state_dict)
        manager.register_state_dict_fn("data", batches.load_state_dict, batches.state_dict)

        run_dir = Path(cfg.run_dir)
        marker = run_dir / f"fault-r{cfg.replica_id}.json"
        fault_step = {1: args.kill_step, 2: args.stop_step}.get(cfg.replica_id, -1)
        armed = fault_step >= 0 and not marker.exists()
        log = open(run_dir / f"metrics-r{cfg.replica_id}.jsonl", "a", buffering=1)  # noqa: SIM115
        while manager.step < args.steps:
            t0 = time.perf_counter()
            opt.zero_grad()  # starts the step
            plan = batches.plan()
            if armed and manager.step == fault_step:
                armed = False
                marker.write_text(json.dumps({"step": manager.step, "pid": os.getpid()}))
                os.kill(os.getpid(), signal.SIGKILL if cfg.replica_id == 1 else signal.SIGSTOP)
            for ids in plan.micro_batches:
                x, y = samples(ids)
                (torch.nn.functional.mse_loss(net(x), y) * plan.loss_scale).backward()
            time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))  # paced before the exchange
            opt.step()
            if manager.last_step_committed:
                batches.commit(plan)
                d = manager.decision
                assert d is not None
                log.write(
                    json.dumps(
                        {
                            "step": plan.step,
                            "ids": [i for mb in plan.micro_batches for i in mb],
                            "members": list(d.members),
                            "behind": list(d.behind),
                            "account": batches.state_dict(),
                        }
                    )
                    + "\n"
                )
        torch.save(
            {"step": manager.step, "model": net.state_dict(), "optim": opt.state_dict()},
            run_dir / f"final-r{cfg.replica_id}.pt",
        )


if __name__ == "__main__":
    fast_exit.install()
    main()
