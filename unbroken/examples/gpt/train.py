"""Trains the small GPT as one replica of a fault-tolerant job.

    unbroken run --replicas 3 -- python -m unbroken.examples.gpt.train --steps 200

(``python examples/gpt/train.py`` in a checkout runs this same file.) It ships inside the
package so that ``unbroken demo`` and the benchmarks run from an installed wheel. The unbroken
parts are marked; the rest is an ordinary PyTorch loop.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import unbroken
from unbroken import fast_exit
from unbroken.examples.gpt.bigram_text import batch, make_corpus
from unbroken.examples.gpt.gpt_model import GPT, GPTConfig


def main() -> None:
    fast_exit.install()  # its exit is on the recovery path: see unbroken/fast_exit.py
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="Steps between checkpoints, when the job has a checkpoint directory (0: none).",
    )
    ap.add_argument(
        "--pace-s",
        type=float,
        default=0.0,
        help="Make each step's compute last at least this long, as a larger model's would (tests and demos).",
    )
    ap.add_argument(
        "--quorum-timeout-s",
        type=float,
        default=600.0,
        help="How long a step waits for a quorum before it fails.",
    )
    args = ap.parse_args()

    torch.manual_seed(args.seed)  # every replica starts from the same weights
    cfg = GPTConfig()
    model = GPT(cfg)
    corpus = make_corpus(cfg.vocab_size, seed=1234)

    # --- unbroken: join the job; register what a recovering peer needs ------------------
    with unbroken.init(quorum_timeout_s=args.quorum_timeout_s) as manager:
        optimizer = unbroken.Optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr), manager)
        # A plain model's own state dicts; an FSDP2 model registers unbroken.model_state(model, optimizer).
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        manager.register_state_dict_fn("optim", optimizer.load_state_dict, optimizer.state_dict)
        manager.register_state_dict_fn("rng", torch.set_rng_state, torch.get_rng_state)
        checkpointer = unbroken.checkpointer_for(manager)  # None unless `unbroken run --checkpoint-dir`
        unbroken.resume(manager, checkpointer)
        # --------------------------------------------------------------------------------
        train(args, model, corpus, cfg, optimizer, manager, checkpointer)
        if checkpointer is not None:
            checkpointer.close()  # waits for the last checkpoint to reach the disk


def train(
    args: argparse.Namespace,
    model: GPT,
    corpus: torch.Tensor,
    cfg: GPTConfig,
    optimizer: unbroken.Optimizer,
    manager: unbroken.Manager,
    checkpointer: unbroken.Checkpointer | None,
) -> None:
    cfg_r = manager.config
    run_dir = Path(cfg_r.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = open(run_dir / f"metrics-r{cfg_r.replica_id}.jsonl", "a", buffering=1)
    while manager.step < args.steps:
        t0 = time.perf_counter()
        optimizer.zero_grad()  # unbroken: starts the step's quorum
        x, y = batch(corpus, manager.step, cfg_r.replica_id, cfg_r.num_replicas, args.batch_size, cfg.block_size)
        loss = model(x, y)
        loss.backward()
        if args.pace_s > 0:
            # Before the exchange, as a larger model's compute would be: every replica leaves the
            # exchange at once and arrives at the next one together. Slept after it, each would
            # keep its own phase, and the one whose clock runs latest would always arrive last
            # (a false straggler to the diagnosis).
            time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))
        step = manager.step
        # unbroken: report the loss before the exchange (a NaN then sits the step out),
        # average across replicas and step if every replica's exchange succeeded, then
        # checkpoint when one is due
        reported = manager.report_loss(loss.item(), step)
        optimizer.step()
        committed = manager.last_step_committed
        if committed:
            unbroken.save_if_due(manager, checkpointer, args.checkpoint_every)
        d = manager.decision
        metrics.write(
            json.dumps(
                {
                    "t": time.time(),
                    "replica": cfg_r.replica_id,
                    "step": manager.step - 1 if committed else step,
                    "loss": reported,
                    "committed": committed,
                    "epoch": d.epoch if d else None,
                    "members": list(d.members) if d else [],
                    "contributing": manager.contributing,
                    "recovered": cfg_r.replica_id in (d.behind if d else ()),
                    # the fingerprint of the sum this replica applied (0: not verified)
                    "exchange_fp": manager.sdc.last_result if committed else 0,
                    "sdc_detected": manager.sdc.detected,
                    "check_s": manager.sdc.spent_s,  # cumulative: the exchange check's own time
                    "step_s": time.perf_counter() - t0,
                    "pid": os.getpid(),
                }
            )
            + "\n"
        )
    final = {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state()}
    torch.save(final | {"step": manager.step}, run_dir / f"final-r{cfg_r.replica_id}.pt")


if __name__ == "__main__":
    main()
