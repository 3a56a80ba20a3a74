"""One member of a bare ICCL ring in the cluster box: all-reduces in a loop, one JSON row each.

    python -m unbroken.cluster.iccl_driver --rank 0 --size 3 --store 198.18.0.10:29600 \\
        --paths eth0,eth1 --numel 2000000 --out ring-0.jsonl --stop-file stop-at

Rank 0 hosts the rendezvous store (the job's authenticated one) on its primary address. Every
row holds the round, its wall time, whether the sum was exact (every element compared with
the value it must have), the hop's active path and counters, and the path events since the
previous row, so that the scenario can time detection, the stall of the round in flight and
the throughput on each path. The run ends at the round written in the stop file (every member
ends at the same one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from unbroken.comm.iccl.monitor import PATH_LOG
from unbroken.comm.iccl.nic_paths import ring_for_epoch
from unbroken.comm.store_client import AuthenticatedStore, StoreError
from unbroken.config import parse_host_port
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT; rank 0 serves it")
    ap.add_argument("--numel", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stop-file", type=Path, required=True)
    args = ap.parse_args()
    secret = JobSecret.required()
    host, port = parse_host_port(args.store, "--store")
    server = StoreServer(host, secret, port) if args.rank == 0 else None
    store = AuthenticatedStore(args.store, secret, timeout=datetime.timedelta(seconds=60), connect_timeout_s=60)
    deadline = time.monotonic() + 60
    while True:  # rank 0 may still be importing torch: its store is not up yet
        try:
            store.set(f"hello/{args.rank}", b"1")
            break
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    ring = ring_for_epoch(secret, args.rank, args.size, store, host, "box", 60.0)
    base = torch.arange(args.numel, dtype=torch.float32).remainder_(1000.0)
    expected = base * args.size + args.size * (args.size - 1) / 2
    t = torch.empty_like(base)
    seen = 0
    stop = args.rounds
    with open(args.out, "a", buffering=1) as out:
        for r in range(args.rounds):
            if r >= stop:
                break
            if args.stop_file.exists():
                stop = min(stop, int(args.stop_file.read_text() or stop))
                if r >= stop:
                    break
            torch.add(base, float(args.rank), out=t)
            t0, wall = time.perf_counter(), time.time()
            ring.start(t).wait(120)
            dt = time.perf_counter() - t0
            events, seen = PATH_LOG.since(seen)
            row = {
                "round": r,
                "t": wall,
                "s": round(dt, 4),
                "exact": bool(torch.equal(t, expected)),
                "active": ring.paths.active,
                "failovers": ring.paths.failovers,
                "failbacks": ring.paths.failbacks,
                "corrupt_chunks": PATH_LOG.corrupt_chunks,
                "corrupted_sent": getattr(ring._fault, "count", 0),
                "bytes": args.numel * 4,
                "events": events,
                "verdicts": ring.watch.verdicts(),
            }
            out.write(json.dumps(row) + "\n")
    ring.close(wait_s=2.0)
    if server is not None:
        time.sleep(1.0)  # the others' last store reads are over long before
        server.close()


if __name__ == "__main__":
    main()
