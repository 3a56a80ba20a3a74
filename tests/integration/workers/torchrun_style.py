"""A training script written for torchrun, run under ``unbroken run`` (an embedding check).

It reads torchrun's variables, creates the default process group itself and installs its own
SIGUSR1 handler (as Slurm and Lightning do) before ``unbroken.init()``; it registers its state
after construction and leaves through the context manager. Writes
``torchrun-r{R}-rank{K}.json`` into the run directory with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unbroken
from unbroken import fast_exit

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    seen = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    dist.init_process_group("gloo")  # the script's own group, as under torchrun
    world = dist.group.WORLD
    caught: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: caught.append(signum))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)

    with unbroken.init() as manager:
        cfg = manager.config
        optimizer = unbroken.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), manager)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        state = unbroken.model_state(model, optimizer)
        manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
        position: dict[str, Any] = {"step": 0}
        manager.register_state_dict_fn("data", position.update, lambda: dict(position))
        try:
            manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
            duplicate = ""
        except ValueError as e:
            duplicate = str(e)
        while manager.step < args.steps:
            optimizer.zero_grad()
            g = torch.Generator().manual_seed(manager.step * 31 + cfg.replica_id * 7 + cfg.rank)
            model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
            optimizer.step()
            if manager.last_step_committed:
                scheduler.step()
                position["step"] = manager.step
        os.kill(os.getpid(), signal.SIGUSR1)  # the stack dump, then the script's own handler
        deadline = time.monotonic() + 10
        while not caught and time.monotonic() < deadline:
            time.sleep(0.01)
        out = {
            "env": seen,
            "same_group": dist.group.WORLD is world,
            "duplicate": duplicate,
            "caught": caught,
            "keys": sorted(manager.state_dict()["user"]),
            "step": manager.step,
            "lr": optimizer.param_groups[0]["lr"],
            "weight": model.weight.detach().flatten().tolist(),
        }
        (Path(cfg.run_dir) / f"torchrun-r{cfg.replica_id}-rank{cfg.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    fast_exit.install()
    main()
