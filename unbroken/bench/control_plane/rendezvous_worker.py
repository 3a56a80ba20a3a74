"""One member of ``unbroken bench rendezvous``: rebuilds its cross-replica group every epoch.

Each epoch starts at a time the parent set (``go``, ``time.monotonic()``: one clock for the
machine) plus ``period_s`` per epoch; the member joins the epoch's group on the store of the
epoch's leader (``stores[epoch % size]``, epochs numbered from 1, as the coordinator turns it)
and runs one all-reduce, which waits for the group's build. It reports, per epoch, the seconds from the epoch's start to
that all-reduce done.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.wire.auth import JobSecret


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--stores", required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--period-s", type=float, required=True)
    p.add_argument("--dir", type=Path, required=True)
    args = p.parse_args()
    stores = args.stores.split(",")
    secret = JobSecret.required()
    group = CrossReplicaGroup(secret, timeout_s=60.0, rendezvous_s=60.0)
    (args.dir / f"ready{args.rank}").touch()
    go = args.dir / "go"
    while not go.exists():  # written whole, then renamed into place
        time.sleep(0.05)
    t0 = float(go.read_text())
    done: list[float] = []
    for epoch in range(args.epochs):
        start = t0 + epoch * args.period_s
        time.sleep(max(0.0, start - time.monotonic()))
        number, members = epoch + 1, list(range(args.size))  # the leader: members[number % size], as the coordinator's
        group.configure(stores[number % args.size], number, args.rank, args.size, "bench", torch.device("cpu"), members)
        ones = torch.ones(1024)
        group.allreduce_sum(ones, 60.0)
        done.append(time.monotonic() - start)
        if float(ones[0]) != args.size:
            raise SystemExit(f"the all-reduce of epoch {epoch + 1} summed {float(ones[0])}, not {args.size}")
    group.close(10.0)
    (args.dir / f"r{args.rank}.json").write_text(json.dumps({"rank": args.rank, "done_s": done}))


if __name__ == "__main__":
    main()
