"""``unbroken bench rendezvous``: what rebuilding the cross-replica groups costs, and where they meet.

At 100,000 GPUs (12 replicas of about 8,192 ranks) an epoch change rebuilds 8,192 cross-replica
groups of 12 members at once. Each member's rendezvous is 25 store requests in a group of 12
(``2 x members + 1``, as counted on the stores here: Gloo's full mesh and the backend's choice).
Met on one store, the coordinator's, that is some 2.5 million requests through one process,
which serves a connection per thread and at most :data:`~unbroken.wire.store.MAX_CONNECTIONS` of
them. Met on the stores of the epoch leader's nodes (each node agent hosts one:
:mod:`unbroken.launch.node.agent`), each store serves the groups of its own node's ranks (8 at 8 GPUs
a node), whatever the job's size.

Three measurements, on this machine:

* ``group``: ``--members`` processes build a Gloo group on the store of the epoch's leader (one
  store per simulated node, the leader turned with the epoch, as the coordinator picks it), for
  ``--epochs`` epochs; each epoch's figure is the time from its start to the last member's first
  all-reduce done: the rebuild every survivor waits for.
* ``node``: one store serving the rendezvous requests of the ``--ranks-per-node`` groups it leads,
  every member on its own connection at once (from two client processes).
* ``central``: the requests a second one store answers to ``--clients`` connections (every peer
  key present, every connection open before the clock starts: the store's best case), and what
  100,000 ranks' rendezvous would take at that rate.

``rebuild_at_scale_s``, what ``unbroken simulate goodput`` reads: the group's slowest rebuild
plus the node's store time, as if one came after the other (they overlap in a real rebuild).
Not measured here: NCCL's communicator init across nodes, and the store sharing its process with
the agent's relay.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

from unbroken.bench.output import publish
from unbroken.config import ENV_SECRET_FILE
from unbroken.launch.workers import package_path
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import MAX_CONNECTIONS, StoreServer

RANKS_100K = 100_000


def requests_per_rank(members: int) -> int:
    """A member's rendezvous requests: Gloo's full mesh (its address, its peers') and the backend's
    choice (its device, every member's): 25 in a group of 12."""
    return (1 + members - 1) + (1 + members)


def group_rebuilds(members: int, epochs: int, period_s: float, timeout_s: float = 300.0) -> dict[str, Any]:
    """``members`` processes rebuild their group every ``period_s`` on the epoch leader's store."""
    secret = JobSecret.generate()
    stores = [StoreServer("127.0.0.1", secret) for _ in range(members)]  # one per simulated node
    with tempfile.TemporaryDirectory(prefix="unbroken-rendezvous-") as tmp:
        env = {
            **os.environ,
            **package_path(),
            ENV_SECRET_FILE: str(secret.write(Path(tmp) / "secret")),
            "OMP_NUM_THREADS": "1",
        }
        go = Path(tmp) / "go"
        procs = []
        try:
            for rank in range(members):
                cmd = [
                    sys.executable, "-m", "unbroken.bench.control_plane.rendezvous_worker", "--rank", str(rank),
                    "--size", str(members), "--stores", ",".join(s.address for s in stores),
                    "--epochs", str(epochs), "--period-s", str(period_s), "--dir", tmp,
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env))
            deadline = time.monotonic() + timeout_s
            while sum(1 for r in range(members) if (Path(tmp) / f"ready{r}").exists()) < members:
                if time.monotonic() > deadline or any(p.poll() for p in procs):
                    raise click.ClickException("a rendezvous member did not get ready")
                time.sleep(0.1)
            (Path(tmp) / "go.tmp").write_text(str(time.monotonic() + 1.0))  # CLOCK_MONOTONIC: the machine's
            (Path(tmp) / "go.tmp").rename(go)
            codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            served = [s.served for s in stores]
            for s in stores:
                s.close()
        if any(codes):
            raise click.ClickException(f"a rendezvous member failed (exit codes {codes})")
        reports = [json.loads((Path(tmp) / f"r{r}.json").read_text()) for r in range(members)]
    rebuild = [max(r["done_s"][e] for r in reports) for e in range(epochs)]
    return {
        "members": members,
        "epochs": epochs,
        "rebuild_s": [round(s, 3) for s in rebuild],
        "rebuild_s_median": round(statistics.median(rebuild), 3),
        "rebuild_s_max": round(max(rebuild), 3),
        "requests_per_store": served,  # each epoch's on its leader's, none on any other
        "requests_per_rank": requests_per_rank(members),
    }


def _client(address: str, key: bytes, threads: int, ranks: int, members: int, out: Any) -> None:
    """One client process: ``threads`` connections, each making the requests of its share of ranks."""
    from unbroken.comm.store_client import AuthenticatedStore

    secret = JobSecret(key)
    stores = [AuthenticatedStore(address, secret, timeout=datetime.timedelta(seconds=60)) for _ in range(threads)]
    for peer in range(members):
        stores[0].set(f"peer{peer}", b"x" * 64)  # every peer's key is there: no request waits
    for s in stores:
        s.set("warm", b"1")  # connected and authenticated before the clock starts
    barrier = threading.Barrier(threads + 1)

    def work(i: int) -> None:
        s = stores[i]
        barrier.wait()
        for rank in range(i, ranks, threads):
            group, me = divmod(rank, members)
            s.set(f"g{group}/addr{me}", b"x" * 64)
            s.set(f"g{group}/gpu{me}", b"cpu")
            for peer in range(members - 1):
                s.get(f"peer{peer}")
            for peer in range(members):
                s.get(f"peer{peer}")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.monotonic()
    for w in workers:
        w.join()
    out.send((started, time.monotonic()))


def central_rate(clients: int, ranks: int, members: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """The requests a second one store serves to ``clients`` connections doing rendezvous requests."""
    secret = JobSecret.generate()
    server = StoreServer("127.0.0.1", secret)
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        for n in range(2):
            recv, send = ctx.Pipe(duplex=False)
            share = ranks // 2 + (ranks % 2 if n == 0 else 0)
            p = ctx.Process(target=_client, args=(server.address, secret.key, clients // 2, share, members, send))
            p.start()
            send.close()  # the child's end: a child that dies closes it, and the wait below ends
            pipes.append(recv)
            procs.append(p)
        spans = []
        for pipe in pipes:
            if not pipe.poll(timeout_s):
                raise click.ClickException(f"a rendezvous client did not report within {timeout_s:.0f}s")
            try:
                spans.append(pipe.recv())
            except EOFError as e:
                raise click.ClickException("a rendezvous client died before it reported") from e
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.close()
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    per_rank = requests_per_rank(members)
    rate = ranks * per_rank / wall
    return {
        "clients": clients,
        "ranks": ranks,
        "requests": ranks * per_rank,
        "wall_s": round(wall, 3),
        "requests_per_s": round(rate),
        "rendezvous_100k_s": round(RANKS_100K * per_rank / rate, 1),
        "max_connections": MAX_CONNECTIONS,
    }


@click.command()
@click.option("--members", type=int, default=12, show_default=True, help="Replicas: members of each group.")
@click.option(
    "--ranks-per-node",
    type=int,
    default=8,
    show_default=True,
    help="Groups a leader node's store serves at once (one per rank of the node).",
)
@click.option("--epochs", type=int, default=8, show_default=True)
@click.option("--period-s", type=float, default=4.0, show_default=True, help="Seconds between epochs.")
@click.option("--clients", type=int, default=64, show_default=True, help="Connections to the one store.")
@click.option("--ranks", type=int, default=4000, show_default=True, help="Ranks whose requests they make.")
@click.option("--out", default="runs/bench/rendezvous.json", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def rendezvous(
    members: int, ranks_per_node: int, epochs: int, period_s: float, clients: int, ranks: int, out: str, as_json: bool
) -> None:
    """A group rebuilt on its leader's store, against every group on one store."""
    if members < 2 or ranks_per_node < 1 or epochs < 1 or clients < 2 or ranks < clients:
        raise click.UsageError(
            "--members must be at least 2, --ranks-per-node and --epochs 1, --clients 2, and --ranks >= --clients"
        )
    group = group_rebuilds(members, epochs, period_s)
    # A leader node's store serves the groups of all its ranks at once: their members' requests,
    # each on its own connection, all at the same time.
    at_node = ranks_per_node * members
    served = central_rate(max(2, at_node), at_node, members)
    node = {k: served[k] for k in ("clients", "ranks", "requests", "wall_s", "requests_per_s")}
    node["groups"] = ranks_per_node
    result = {
        "group": group,
        "node": node,
        "central": central_rate(clients, ranks, members),
        # What the projection reads: one group's slowest rebuild, and its node's store serving every
        # group it leads, one after the other (they overlap in a real rebuild).
        "rebuild_at_scale_s": round(group["rebuild_s_max"] + node["wall_s"], 3),
    }
    path = publish(result, out, as_json)
    if not as_json:
        g, c = result["group"], result["central"]
        click.echo(
            f"a group of {members} rebuilt on its leader's store: median {g['rebuild_s_median']}s, "
            f"max {g['rebuild_s_max']}s over {epochs} epochs"
        )
        click.echo(
            f"a leader node's store serving its {ranks_per_node} groups ({at_node} members): {node['wall_s']}s; "
            f"a rebuild at any size: {result['rebuild_at_scale_s']}s"
        )
        click.echo(
            f"one store: {c['requests_per_s']} requests/s to {clients} connections; 100,000 ranks' "
            f"rendezvous there would take {c['rendezvous_100k_s']}s (it serves {MAX_CONNECTIONS} connections at most)"
        )
        click.echo(f"written to {path}")
