"""One rank of a replica in the cluster box: an MLP sharded with FSDP2 over its replica group.

    python -m unbroken.cluster.worker --steps 60 --width 256

Inside a replica FSDP2 reduce-scatters over the replica's own ranks (which may sit on several
hosts: the group's rendezvous is on the host of group rank 0); across replicas,
``unbroken.average_gradients`` exchanges each rank's shard with the same shard of the other
replicas. Rank 0 appends one JSON line per step to ``metrics-r{R}.jsonl`` (step, epoch,
committed, members); every rank writes ``final-r{R}-rank{K}.json`` at the end: the SHA-256 of
its parameters and optimizer state, by which replicas are compared bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken
from unbroken.comm.iccl.monitor import PATH_LOG
from unbroken.train.state import as_local


def digest(state: dict[str, object]) -> str:
    """SHA-256 over every tensor of a (nested) state dict, in key order."""
    h = hashlib.sha256()

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", state)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=128, help="hidden width: the gradient is about 2*width*64 floats")
    ap.add_argument("--pace-s", type=float, default=0.1, help="each step lasts at least this long")
    ap.add_argument(
        "--stop-file",
        type=Path,
        default=None,
        help="a file the harness writes a step number to: every replica then ends at that step "
        "(a run as long as its scenario needs, with every replica ending at the same step)",
    )
    args = ap.parse_args()

    with unbroken.init() as manager:
        cfg = manager.config
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 64))
        if cfg.world_size > 1:
            fully_shard(net, mesh=init_device_mesh("cpu", (cfg.world_size,)))  # shards net in place
        model: torch.nn.Module = net
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state = unbroken.model_state(model, opt)
        manager.register_state_dict_fn("train", state.load_state_dict, state.state_dict)
        manager.expect_gradients(unbroken.gradient_numel(model.parameters()))
        run_dir = Path(cfg.run_dir)
        metrics = open(run_dir / f"metrics-r{cfg.replica_id}.jsonl", "a", buffering=1) if cfg.rank == 0 else None
        steps = args.steps
        seen = 0  # ICCL path events already written
        while manager.step < steps:
            if args.stop_file is not None and args.stop_file.exists():
                steps = min(steps, int(args.stop_file.read_text() or steps))
                if manager.step >= steps:
                    break
            t0 = time.perf_counter()
            manager.start_step()
            opt.zero_grad()
            g = torch.Generator().manual_seed(manager.step * 101 + cfg.replica_id * 7 + cfg.rank)
            x = torch.randn(16, 64, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
            loss.backward()
            time.sleep(max(0.0, args.pace_s - (time.perf_counter() - t0)))
            step = manager.step
            committed = unbroken.average_gradients(manager, model.parameters())
            if committed:
                opt.step()
                manager.commit()
            if metrics is not None:
                d = manager.decision
                row: dict[str, Any] = {
                    # The step this exchange committed: a catching-up replica's own count jumps to
                    # its donor's step in the exchange.
                    "step": manager.step - 1 if committed else step,
                    "committed": committed,
                    "epoch": d.epoch if d else None,
                    "members": list(d.members) if d else [],
                    "behind": list(d.behind) if d else [],
                    "step_s": round(time.perf_counter() - t0, 4),
                    "t": time.time(),
                }
                events, seen = PATH_LOG.since(seen)
                if events or PATH_LOG.corrupted_sent or PATH_LOG.corrupt_chunks:  # UNBROKEN_EXCHANGE=iccl
                    row["iccl"] = {
                        "events": events,
                        "corrupt_chunks": PATH_LOG.corrupt_chunks,
                        "corrupted_sent": PATH_LOG.corrupted_sent,
                    }
                metrics.write(json.dumps(row) + "\n")
        final = {"step": manager.step, "digest": digest(as_local(state.state_dict()))}
        (run_dir / f"final-r{cfg.replica_id}-rank{cfg.rank}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main()
