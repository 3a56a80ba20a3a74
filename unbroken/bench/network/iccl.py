"""``unbroken bench iccl``: the ICCL ring's all-reduce against Gloo's, on the same tensors, A/B.

N processes on this machine (loopback; primary and backup paths on 127.0.0.1 and 127.0.0.2)
each hold a Gloo process group and an :class:`~unbroken.comm.iccl.IcclRing`. Rounds alternate
the order (Gloo then ICCL, ICCL then Gloo: ABBA) so that load from other processes falls on both;
every timed all-reduce starts after a barrier and ends when the slowest member is done. The
sums are checked against the expected value every round (both methods).

``--corrupt N`` makes rank 0's NIC flip a byte in every ``--corrupt-every``-th chunk until N were
corrupted: the receivers must resend every one and the sums stay exact (bitwise equal to Gloo's).
``--fail-primary-at`` shuts rank 0's primary connection down in the middle of one all-reduce:
that all-reduce must complete on the backup with the right sum.
"""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish


def _worker(rank: int, size: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from unbroken.comm.iccl import IcclRing
    from unbroken.comm.iccl.faults import CorruptingNic
    from unbroken.wire.auth import JobSecret

    torch.set_num_threads(1)
    if cfg["no_checksum"]:  # the cost experiment only: the wire is then unchecked
        from unbroken.comm.iccl import protocol

        protocol.crc_of = lambda data, value=0: 0  # type: ignore[assignment]
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=120))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, datetime.timedelta(seconds=120))
    fault = CorruptingNic(cfg["corrupt"], cfg["corrupt_every"]) if cfg["corrupt"] and rank == 0 else None
    ring = IcclRing.rendezvous(
        JobSecret(bytes.fromhex(cfg["key"])),
        rank,
        size,
        dist.PrefixStore("iccl", store),
        ("127.0.0.1", "127.0.0.2"),
        chunk_bytes=cfg["chunk_bytes"],
        fault=fault,
        ring_id="bench",
        socket_buffer=cfg["socket_buffer"] or None,
    )
    numel = cfg["numel"]
    src = torch.arange(numel, dtype=torch.float32).remainder_(1000.0).add_(rank)
    expected = torch.arange(numel, dtype=torch.float32).remainder_(1000.0).mul_(size).add_(size * (size - 1) / 2)
    work = torch.empty_like(src)
    methods = ["gloo", "iccl"] + (["iccl_nomon"] if cfg["monitor_ab"] else [])
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, float] = {m: 0.0 for m in methods}  # this process's CPU seconds (every thread)
    wrong = {m: 0 for m in methods}
    failover: dict[str, Any] = {}

    def barrier() -> None:
        gloo.barrier().wait()  # type: ignore[attr-defined]  # torch's stub lacks it

    def one(method: str, r: int) -> None:
        work.copy_(src)
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if method == "gloo":
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
            gloo.allreduce([work], opts).wait()  # type: ignore[attr-defined]
        else:
            ring._monitor = method == "iccl"  # iccl_nomon: the same ring without its window monitor
            w = ring.start(work)
            if rank == 0 and r == cfg["fail_primary_at"]:
                time.sleep(0.02)
                sock = ring._out[0]
                if sock is not None:
                    import socket

                    sock.shutdown(socket.SHUT_RDWR)  # the primary connection dies mid-collective
                    failover["at_s"] = time.perf_counter() - t0
            w.wait(120)
        cpu[method] += time.process_time() - c0
        barrier()
        times[method].append(time.perf_counter() - t0)
        if not torch.equal(work, expected):
            wrong[method] += 1

    for r in range(cfg["rounds"]):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for m in order if r % 2 == 0 else order[::-1]:
            one(m, r)
    stats = ring.link_stats()
    corrupt_seen = ring.corrupt_chunks
    barrier()  # no member closes its ring while another still reads its figures
    ring.close()
    out.put(
        {
            "rank": rank,
            "times": times,
            "cpu": cpu,
            "wrong": wrong,
            "corrupted_sent": fault.count if fault else 0,
            "corrupt_detected": corrupt_seen,
            "links": stats,
            "failover": failover,
        }
    )


def run_ab(
    size: int,
    numel: int,
    rounds: int,
    chunk_bytes: int,
    corrupt: int = 0,
    corrupt_every: int = 1,
    fail_primary_at: int = -1,
    socket_buffer: int = 4 << 20,
    no_checksum: bool = False,
    monitor_ab: bool = False,
) -> dict[str, Any]:
    import multiprocessing as mp
    import socket

    from unbroken.wire.auth import JobSecret

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {
        "numel": numel,
        "rounds": rounds,
        "chunk_bytes": chunk_bytes,
        "corrupt": corrupt,
        "corrupt_every": corrupt_every,
        "fail_primary_at": fail_primary_at,
        "socket_buffer": socket_buffer,
        "no_checksum": no_checksum,
        "monitor_ab": monitor_ab,
        "key": JobSecret.generate().key.hex(),
    }
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, size, port, cfg, q), daemon=True) for r in range(size)]
    for pr in procs:
        pr.start()
    results = []
    try:
        for _ in range(size):
            results.append(q.get(timeout=600))
    finally:
        for pr in procs:
            pr.join(30)
            if pr.is_alive():
                pr.kill()
    results.sort(key=lambda r: r["rank"])
    # The collective's time is the slowest member's.
    methods = list(results[0]["times"])
    per_round = {m: [max(r["times"][m][i] for r in results) for i in range(rounds)] for m in methods}
    med = {m: statistics.median(v) for m, v in per_round.items()}
    pairs = [i / g for i, g in zip(per_round["iccl"], per_round["gloo"], strict=True)]
    extra: dict[str, Any] = {}
    if "iccl_nomon" in med:
        mon = [a / b for a, b in zip(per_round["iccl"], per_round["iccl_nomon"], strict=True)]
        extra = {
            "iccl_nomon_median_s": round(med["iccl_nomon"], 4),
            "monitor_cost_paired_median": round(statistics.median(mon) - 1.0, 4),
            "iccl_nomon_s": [round(x, 4) for x in per_round["iccl_nomon"]],
        }
    return {
        **extra,
        "size": size,
        "numel": numel,
        "mbytes": numel * 4 / 1e6,
        "rounds": rounds,
        "chunk_bytes": chunk_bytes,
        "gloo_median_s": round(med["gloo"], 4),
        "iccl_median_s": round(med["iccl"], 4),
        "ratio_of_medians": round(med["iccl"] / med["gloo"], 3),
        "paired_median_ratio": round(statistics.median(pairs), 3),
        "gloo_s": [round(x, 4) for x in per_round["gloo"]],
        "iccl_s": [round(x, 4) for x in per_round["iccl"]],
        "wrong_sums": {m: sum(r["wrong"][m] for r in results) for m in methods},
        # CPU seconds per all-reduce, summed over the members: what a busy machine pays
        "cpu_s_per_allreduce": {m: round(sum(r["cpu"][m] for r in results) / rounds, 4) for m in methods},
        "corrupted_sent": sum(r["corrupted_sent"] for r in results),
        "corrupt_detected": sum(r["corrupt_detected"] for r in results),
        "failover": results[0]["failover"],
        "links_rank0": results[0]["links"],
    }


@click.command()
@click.option("--replicas", "sizes", multiple=True, type=int, default=(2, 3, 4), show_default=True)
@click.option("--numel", "numels", multiple=True, type=int, default=(25_000_000, 100_000_000), show_default=True)
@click.option("--rounds", type=int, default=6, show_default=True, help="ABBA rounds per configuration.")
@click.option("--chunk-bytes", type=int, default=4 << 20, show_default=True)
@click.option("--socket-buffer", type=int, default=4 << 20, show_default=True, help="0: the kernel's autotuning.")
@click.option("--corrupt", type=int, default=0, help="Corrupt this many chunks sent by rank 0 (0: none).")
@click.option("--corrupt-every", type=int, default=1, show_default=True)
@click.option("--fail-primary-at", type=int, default=-1, help="Kill rank 0's primary connection in this round.")
@click.option(
    "--no-checksum-experiment",
    "no_checksum",
    is_flag=True,
    hidden=True,
    help="Measure what the CRC costs: ICCL without it (never for training).",
)
@click.option("--monitor-ab", is_flag=True, help="Also time the ring with its window monitor off (its cost).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/iccl.json"), show_default=True)
def iccl(
    sizes: tuple[int, ...],
    numels: tuple[int, ...],
    rounds: int,
    chunk_bytes: int,
    socket_buffer: int,
    corrupt: int,
    corrupt_every: int,
    fail_primary_at: int,
    no_checksum: bool,
    monitor_ab: bool,
    as_json: bool,
    out: Path,
) -> None:
    """ICCL ring all-reduce vs Gloo's on the same tensors (ABBA), with optional wire faults."""
    if rounds < 1 or any(s < 2 for s in sizes) or any(n < 1 for n in numels):
        raise click.UsageError("need --rounds >= 1, --replicas >= 2 and --numel >= 1")
    records = []
    for size in sizes:
        for numel in numels:
            rec = run_ab(
                size,
                numel,
                rounds,
                chunk_bytes,
                corrupt,
                corrupt_every,
                fail_primary_at,
                socket_buffer,
                no_checksum,
                monitor_ab,
            )
            click.echo(
                f"n={size} numel={numel}: gloo {rec['gloo_median_s']}s iccl {rec['iccl_median_s']}s "
                f"ratio {rec['ratio_of_medians']} (paired {rec['paired_median_ratio']}) wrong {rec['wrong_sums']}"
                + (f" monitor cost {rec['monitor_cost_paired_median']:+.4f}" if monitor_ab else "")
                + f" cpu/allreduce {rec['cpu_s_per_allreduce']}",
                err=True,
            )
            records.append(rec)
    publish({"records": records, "load": _load()}, out, as_json)


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return ""
