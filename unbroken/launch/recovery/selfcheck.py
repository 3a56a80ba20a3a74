"""Re-admission self-check: can this slot train a few steps and exchange with a peer, in time?

Two processes, the checked one and a reference, train a tiny model for a few steps and average
gradients over Gloo. The check passes when both finish, their parameters agree, and the
checked one's compute time is within ``--ratio`` of the reference's. The checked process gets
the slot's worker faults (the launcher passes whatever is still in effect there), so a slot
that is still slow fails, and one that recovered passes.

    python -m unbroken.launch.recovery.selfcheck --role checked|reference --port P [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("checked", "reference"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=2.0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from unbroken.faults.worker_chaos import WorkerChaos
    from unbroken.train.replica_group import init_gloo_group, rendezvous_store
    from unbroken.wire.auth import JobSecret

    rank = 0 if args.role == "checked" else 1
    # The job's authenticated store on loopback, not a TCPStore listening on every interface.
    store, server = rendezvous_store(f"127.0.0.1:{args.port}", JobSecret.required(), rank == 0, timeout_s=20.0)
    # Gloo's pairs on loopback too, not on what the host name resolves to.
    init_gloo_group("gloo", store, rank, 2, "127.0.0.1", timeout=timedelta(seconds=20))
    chaos = WorkerChaos.from_env(-1) if rank == 0 else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compute = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        if chaos is not None:
            chaos.start_step(step)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if chaos is not None:
            chaos.before_exchange(step, [0, 1], 0)
        compute.append(time.perf_counter() - t0)
        for p in model.parameters():
            g = p.grad
            assert g is not None  # every parameter is in the loss
            dist.all_reduce(g)
            g /= 2
        opt.step()
    mine = torch.tensor([statistics.median(compute)])
    both = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(both, mine)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=1)
    dist.destroy_process_group()
    if server is not None:
        server.close()
    checked, reference = float(both[0]), float(both[1])
    ok = torch.equal(flat, ref) and checked <= args.ratio * max(reference, 1e-4)
    print(json.dumps({"role": args.role, "ok": ok, "checked_compute_s": checked, "reference_compute_s": reference}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
