"""One member of ``unbroken bench epochs``: builds, uses, abandons and releases a cross-replica
group every epoch, the way a flapping job does, and reports what the process holds.

Run as ``python -m unbroken.bench.control_plane.epochs_worker`` by
:mod:`unbroken.bench.control_plane.epochs`. On CPU every
member is a process and the groups are Gloo's; on a GPU, where one device allows one NCCL rank,
one process builds a one-rank NCCL group per epoch through the same build, abort and release
path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm import retire
from unbroken.comm.cross_replica import CrossReplicaGroup, ExchangeFailed
from unbroken.comm.retire import GroupReaper, keep_forever
from unbroken.wire.auth import JobSecret


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """Who is a member of an epoch, and whether its collective is abandoned midway."""

    members: tuple[int, ...]
    aborted: bool


def epoch_plan(epoch: int, size: int, abort_every: int, drop_every: int = 3) -> EpochPlan:
    """Every ``drop_every``-th epoch the last member is out (the membership changes); every
    ``abort_every``-th epoch its last member vanishes mid-collective (the others' all-reduce is
    running when its group goes)."""
    out = size > 2 and drop_every > 0 and epoch % drop_every == 0
    members = tuple(range(size - 1 if out else size))
    return EpochPlan(members, aborted=abort_every > 0 and epoch % abort_every == 0 and len(members) > 1)


class NoLock:
    """A :class:`~unbroken.comm.retire.BoundedLock` that holds nothing (the comparison run)."""

    @contextlib.contextmanager
    def hold(self, timeout_s: float) -> Iterator[None]:
        yield


class KeepAll(GroupReaper):
    """The behaviour before groups were released: every retired group is kept forever."""

    def retire(self, group: Any, backend: str, epoch: int | None, works: Sequence[Any] = ()) -> None:
        keep_forever(group)
        for work in works:  # a Gloo work whose last reference goes while it runs aborts the process
            keep_forever(work)
        self.stuck += 1


def holdings(device: torch.device) -> dict[str, float]:
    """What this process holds now: threads, descriptors, resident memory, GPU memory in use."""
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    out = {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mib": rss_kb / 1024,
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["gpu_used_mib"] = (total - free) / 2**20
    return out


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if args.release == "unlocked":
        retire.NCCL_LIFECYCLE = NoLock()  # type: ignore[assignment]
    secret = JobSecret.required()
    if args.keep:
        # Kept groups' operations must not time out during the run: a Gloo group kept with a
        # timed-out operation aborts the process (terminate on gloo::IoException, seen here).
        args.timeout_s = 3600.0
    linger = args.timeout_s + 5.0
    reaper = KeepAll(linger_s=linger) if args.keep else GroupReaper(linger_s=linger, poll_s=0.05)
    group = CrossReplicaGroup(secret, timeout_s=args.timeout_s, rendezvous_s=30.0, reaper=reaper)
    tensor_numel = args.numel
    rows: list[dict[str, Any]] = []
    failures = 0
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        plan = epoch_plan(epoch, args.size, args.abort_every)
        if device.type == "cuda":
            failures += gpu_epoch(group, reaper, args.store, epoch, plan.aborted, device, tensor_numel, args.release)
        elif args.rank in plan.members:
            failures += cpu_epoch(group, args, epoch, plan, device, tensor_numel)
        if epoch == args.warmup or epoch % args.report_every == 0 or epoch == args.epochs:
            if epoch == args.epochs:
                group.close()
            reaper.drain(linger + 5)  # each row counts what is held, not what waits for release
            rows.append({"epoch": epoch, "s": round(time.perf_counter() - started, 2), **holdings(device)})
    summary = {
        "rank": args.rank,
        "rows": rows,
        "failures": failures,
        "released": reaper.released,
        "aborted": reaper.aborted,
        "stuck": reaper.stuck,
        "abort_ms": sorted(round(s * 1e3, 3) for s in reaper.abort_s),
        "keep": args.keep,
    }
    with open(args.report, "w") as f:
        json.dump(summary, f)
    if args.keep:
        os._exit(0)  # the kept groups' operations are still pending: no interpreter teardown


def cpu_epoch(
    group: CrossReplicaGroup, args: argparse.Namespace, epoch: int, plan: EpochPlan, device: torch.device, numel: int
) -> int:
    rank = plan.members.index(args.rank)
    group.configure(args.store, epoch, rank, len(plan.members), tag="churn", device=device, members=list(plan.members))
    if plan.aborted and args.rank == plan.members[-1]:
        # This member's group is built (the rendezvous needs it) and left behind with no operation,
        # after the others' all-reduce has started and passed its deadline.
        time.sleep(args.deadline_s + 0.3)
        return 0
    try:
        group.allreduce_sum(torch.ones(numel, device=device), args.deadline_s if plan.aborted else 30.0)
    except ExchangeFailed:
        return 1
    return 0


def gpu_epoch(
    group: CrossReplicaGroup,
    reaper: GroupReaper,
    store: str,
    epoch: int,
    aborted: bool,
    device: torch.device,
    numel: int,
    release: str = "reaper",
) -> int:
    """A one-rank NCCL group (one device allows one rank): built, used, and retired to the reaper,
    which aborts it; an aborted epoch retires it with its all-reduce still queued.

    ``release``: ``reaper`` (the job's way), ``inline`` (aborted on this thread at once: nothing
    runs beside the next build), ``serial`` (the reaper's abort finished before the next build)
    or ``unlocked`` (the reaper's way without :data:`~unbroken.comm.retire.NCCL_LIFECYCLE`: its
    aborts may run beside a build)."""
    if release == "serial":
        reaper.drain(30.0)
    prefix = dist.PrefixStore(f"churn/epoch{epoch}", group._store(store))
    pg = group.make_group("nccl", prefix, 0, 1, store, device)
    tensor = torch.ones(numel, device=device)
    work = pg.allreduce([tensor])
    if not aborted:
        work.wait()
        torch.cuda.synchronize(device)
    if release == "inline":
        pg.abort()
    else:
        reaper.retire(pg, "nccl", epoch, [work.get_future()])
    del pg, work
    if epoch % 10 == 0:
        print(f"epoch {epoch}: {json.dumps(holdings(device))}", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--size", type=int, default=3)
    p.add_argument("--store", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--abort-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--report-every", type=int, default=100)
    p.add_argument("--deadline-s", type=float, default=0.3)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--numel", type=int, default=1 << 16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--release", choices=("reaper", "inline", "serial", "unlocked"), default="reaper")
    p.add_argument("--keep", action="store_true", help="keep every group forever (the old behaviour)")
    p.add_argument("--report", required=True)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
