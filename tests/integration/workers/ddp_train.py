"""Trains a small MLP with ``unbroken.DistributedDataParallel`` the way an LLM loop does.

``unbroken.Optimizer`` over AdamW, a ``LambdaLR`` warm-up on it and ``clip_grad_norm_``
between ``backward()`` and ``optimizer.step()``: the clip sees the cross-replica average
because the wrapper averages during the backward pass.
Each step accumulates ``MICRO`` micro-batches, all but the last under ``no_sync()``.
Replica R's batch at step S depends only on (S, R), so a test can recompute the whole run in
one process. Writes ``metrics-r{R}.jsonl`` and ``final-r{R}.pt``.

``--fault kill|stop`` makes replica ``--fault-replica`` kill -9 (or SIGSTOP) itself at step
``--fault-step`` from inside its backward pass, once the first bucket's exchange is in flight
and before the last one starts; it first writes ``fault-r{R}.json`` with how many buckets it had
started. That happens once per run (not again in the restarted process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import unbroken
from unbroken import fast_exit

IN, HIDDEN, OUT = 16, 32, 4
MAX_NORM = 0.05  # small enough that every step clips
MICRO = 2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def build_optimizer(
    model: torch.nn.Module, manager: Any = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a warm-up; wrapped in ``unbroken.Optimizer`` when a manager is given."""
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if manager is not None:
        opt = unbroken.Optimizer(opt, manager)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


def batch(step: int, replica: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + rank)
    x = torch.randn(8, IN, generator=g)
    return x, torch.randn(8, OUT, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pace-s", type=float, default=0.0)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.002)
    ap.add_argument("--fault", choices=["kill", "stop"], default=None)
    ap.add_argument("--fault-step", type=int, default=10)
    ap.add_argument("--fault-replica", type=int, default=1)
    args = ap.parse_args()

    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return {
            "model": holder["net"].state_dict(),
            "optim": holder["opt"].state_dict(),
            "sched": holder["sched"].state_dict(),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        holder["net"].load_state_dict(state["model"])
        holder["opt"].load_state_dict(state["optim"])
        holder["sched"].load_state_dict(state["sched"])

    manager = unbroken.init(state_dict=state_dict, load_state_dict=load_state_dict)
    cfg = manager.config
    net = build_model()
    opt, sched = build_optimizer(net, manager)
    holder.update(net=net, opt=opt, sched=sched)

    run_dir = Path(cfg.run_dir)
    marker = run_dir / f"fault-r{cfg.replica_id}.json"
    armed = args.fault is not None and cfg.replica_id == args.fault_replica and not marker.exists()

    def fault(_: torch.Tensor) -> None:
        nonlocal armed
        if armed and manager.step == args.fault_step and 0 < model.buckets_started:
            armed = False
            marker.write_text(
                json.dumps({"buckets_started": model.buckets_started, "step": manager.step, "pid": os.getpid()})
            )
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)

    # The first layer's gradient comes last: the other buckets are in flight by then. Registered
    # before the wrapper's hooks, so this runs before the wrapper starts that bucket.
    net[0].weight.register_post_accumulate_grad_hook(fault)
    model = unbroken.DistributedDataParallel(net, manager, bucket_cap_mb=args.bucket_cap_mb)

    metrics = open(run_dir / f"metrics-r{cfg.replica_id}.jsonl", "a", buffering=1)
    while manager.step < args.steps:
        t0 = time.perf_counter()
        step = manager.step
        opt.zero_grad()
        # Paced before the compute, whose last backward runs the exchange: replicas reach it together.
        time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))
        for micro in range(MICRO):
            with model.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                x, y = batch(step, cfg.replica_id, micro)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()  # ends the exchange (already done during backward) and commits
        committed = manager.last_step_committed
        if committed:
            sched.step()
        d = manager.decision
        metrics.write(
            json.dumps(
                {
                    "step": step,
                    "loss": loss.item(),
                    "norm": norm.item(),
                    "committed": committed,
                    "members": list(d.members) if d else [],
                    "behind": list(d.behind) if d else [],
                    "t": time.time(),
                }
            )
            + "\n"
        )
    torch.save(
        {"step": manager.step, "model": net.state_dict(), "optim": opt.state_dict()},
        run_dir / f"final-r{cfg.replica_id}.pt",
    )
    manager.shutdown()


if __name__ == "__main__":
    fast_exit.install()
    main()
