"""``unbroken bench coordinator``: what one coordinator costs at 10 to 5,000 replica groups.

One real coordinator process (``unbroken coordinator``, and a ``--standby`` beside it) and
simulated replica groups (:mod:`unbroken.bench.control_plane.coordinator_sim`) spread over a few client
processes, speaking the real, authenticated protocol at a fixed step time. Per size:

* ``quorum_p50_ms`` / ``quorum_p99_ms``: a quorum request's round trip on the fast path (same
  members, steps before any fault);
* ``disconnect_to_epoch_ms``: from one group's connection closing to the last survivor holding
  the new epoch (eviction, the abort pushed to every member, their re-asks, the answer);
* ``rejoin_admit_ms``: from the evicted group's reconnection to its admission (it waits for the
  members' next step: up to one step time of it is the schedule, not the coordinator);
* ``cpu_ms_per_step``: the coordinator's CPU over the fast-path steps, per step (and per
  request), heartbeats and ticks included; ``rss_mib``: its resident memory at the end;
* ``bytes_per_client_step``: what one group receives per fast-path step;
* ``takeover_ms`` (with the standby): from ``kill -9`` of the active coordinator to the last
  group reconnected to the standby; ``takeover_quorum_ms``: to the last group answered by the
  standby (which continues the epoch: :mod:`unbroken.control.quorum.resume`; the kill comes just before
  a step: this includes the step's spread of asks, up to ``jitter`` of a step);
  ``takeover_held_ms``: what the takeover cost the job, how far every group's schedule moved
  after the kill (a group starts no step before every group was answered for the one before:
  :mod:`unbroken.bench.training.lockstep`).

Are the clients the bottleneck? Each client process reports its CPU time; ``client_cpu_util``
is the busiest one's share of the run (under 0.5: it was not saturated on average; an eviction
is a burst that each client process handles in turn, so part of ``disconnect_to_epoch_ms`` is
theirs). ``--client-procs`` changes their number: the figures should not move. Their garbage
collector is off for the run (:mod:`unbroken.bench.control_plane.coordinator_sim`): its pauses were theirs,
not the coordinator's. At 5,000 groups they need a core between them, and on a 2-core machine
the figures of that size vary from run to run (docs/benchmarks/2026-11-26-coordinator-scale.md).

The machine is shared: timings are meaningful only when it is otherwise idle (``uptime``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from unbroken import config
from unbroken.bench.control_plane.coordinator_sim import Plan, client_process
from unbroken.bench.output import publish
from unbroken.control.state import secret_file
from unbroken.launch.workers import free_port

QUICK_SIZES = (10, 100)
FULL_SIZES = (10, 100, 1000, 5000)
# The schedule of one size, in steps: fast path, the disconnect, the rejoin, the takeover
# (all shifted by ``--warmup-steps``: the coordinator learns the step time before it grants steps).
FAST_STEP = 2
DISCONNECT_STEP = 8
REJOIN_STEP = 11
TAKEOVER_STEP = 15
STEPS = 19
HEARTBEAT_S = 0.1  # until the welcome says otherwise: the coordinator sets the pace for its size


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _start_coordinator(
    size: int,
    state_dir: Path,
    port: int,
    standby: bool,
    max_asks_per_s: float | None = None,
    lease_store: str = "file",
) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "unbroken",
        "coordinator",
        "--replicas",
        str(size),
        "--min-replicas",
        "1",
        "--port",
        str(port),
        "--state-dir",
        str(state_dir),
        "--max-connections",
        str(size + 64),
        "--heartbeat-timeout",
        "10",
        "--secret-file",  # the bench's own, whatever UNBROKEN_SECRET_FILE says
        str(state_dir / secret_file.SECRET_NAME),
    ]
    if standby:
        args.append("--standby")
    if lease_store != "file":
        args += ["--lease-store", lease_store]
    if max_asks_per_s is not None:
        args += ["--max-asks-per-s", str(max_asks_per_s)]
    path = [str(Path(__file__).parents[3]), config.python_path() or ""]
    env = {**os.environ, config.ENV_PYTHONPATH: os.pathsep.join(p for p in path if p)}
    log = state_dir.parent / f"coordinator-{port}.log"
    with log.open("wb") as f:
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)


def _wait_listening(
    proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0, needle: str = "listening on"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError("the coordinator did not listen in time")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_size(
    size: int,
    step_time: float,
    jitter: float,
    heartbeat_s: float,
    client_procs: int,
    standby: bool,
    work: Path,
    ranks_per_node: int = 0,
    warmup: int = 0,
    max_asks_per_s: float | None = None,
    admit: int = 0,
    warm: bool = True,
    lease_store: str = "file",
) -> dict[str, Any]:
    """One coordinator (and its standby) against ``size`` simulated groups; the figures.

    ``ranks_per_node`` > 0: each group is a node of that many ranks speaking through one
    connection (:mod:`unbroken.bench.control_plane.coordinator_sim_nodes`)."""
    state_dir = work / f"state-{size}"
    secret, _ = secret_file.kept(state_dir)
    port = free_port()
    active = _start_coordinator(size, state_dir, port, False, max_asks_per_s, lease_store)
    procs: list[Any] = []
    coordinators = [active]
    try:
        _wait_listening(active, work / f"coordinator-{port}.log")
        addresses = [("127.0.0.1", port)]
        if standby:
            standby_port = free_port()
            coordinators.append(_start_coordinator(size, state_dir, standby_port, True, max_asks_per_s, lease_store))
            _wait_listening(coordinators[-1], work / f"coordinator-{standby_port}.log", needle="standby: waiting")
            addresses.append(("127.0.0.1", standby_port))
        ctx = multiprocessing.get_context("spawn")
        victim = size - 1
        chunks = [tuple(range(size))[i::client_procs] for i in range(client_procs) if i < size]
        answered = ctx.Value("q", -1)  # the newest step the coordinator answered any group
        held = ctx.Value("d", 0.0)  # seconds the groups' schedule moved for answers that came late
        floors = ctx.Array("q", len(chunks))  # the hold of the exchange (bench.lockstep): a slot per process
        links = []
        for i, chunk in enumerate(chunks):
            plan = Plan(
                addresses=tuple(addresses),
                key=secret.key,
                replicas=chunk,
                t0=0.0,
                steps=warmup + admit + (STEPS if standby else TAKEOVER_STEP),
                step_time=step_time,
                jitter=jitter,
                heartbeat_s=heartbeat_s,
                victim=victim if victim in chunk else None,
                disconnect_step=warmup + DISCONNECT_STEP,
                rejoin_step=warmup + REJOIN_STEP,
                seed=i,
                ranks_per_node=ranks_per_node,
                warm=warm and ranks_per_node > 0,
            )
            ready_r, ready_w = ctx.Pipe(duplex=False)
            go_r, go_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=client_process, args=(plan, ready_w, go_r, out_w, answered, held, floors, i), daemon=True
            )
            p.start()
            procs.append(p)
            links.append((ready_r, go_w, out_r))
        connect_t = time.monotonic()
        for ready_r, _, _ in links:
            if not ready_r.poll(180.0):
                raise RuntimeError("a client process did not connect its groups in time")
            ready_r.recv()
        connect_s = time.monotonic() - connect_t
        t0 = time.monotonic() + 0.5
        for _, go_w, _ in links:
            go_w.send(t0)
        # The coordinator's CPU over the fast-path steps (FAST_STEP to DISCONNECT_STEP): sampled at their edges.
        _sleep_until(t0 + (warmup + FAST_STEP) * step_time, held)
        cpu0 = _proc_cpu_s(active.pid)
        _sleep_until(t0 + (warmup + DISCONNECT_STEP) * step_time, held)
        cpu1 = _proc_cpu_s(active.pid)
        kill_t = None
        held_at_kill = 0.0
        standby_cpu: list[tuple[float, float]] = []
        if standby:
            _sleep_until(t0 + (warmup + admit + TAKEOVER_STEP) * step_time - 0.05 * step_time, held)
            rss = _proc_rss_mib(active.pid)
            kill_t = time.monotonic()
            held_at_kill = held.value
            os.kill(active.pid, signal.SIGKILL)
            standby_cpu = _cpu_trace(coordinators[1].pid, kill_t + 4 * step_time)
        else:
            _sleep_until(t0 + (warmup + admit + TAKEOVER_STEP - 0.5) * step_time, held)
            rss = _proc_rss_mib(active.pid)
        results = []
        for p, (_, _, out_r) in zip(procs, links, strict=False):
            if not out_r.poll(120.0):
                raise RuntimeError("a client process did not report in time")
            results.append(json.loads(out_r.recv()))
            p.join(10.0)
        wall = time.monotonic() - connect_t
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for c in coordinators:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
                try:
                    c.wait(10.0)
                except subprocess.TimeoutExpired:
                    c.kill()
                    c.wait()
    row = _figures(size, step_time, results, cpu1 - cpu0, rss, kill_t, victim, connect_s, wall, t0, warmup)
    if kill_t is not None:
        # What the takeover cost the job: how far every group's schedule moved after the kill.
        row["takeover_held_ms"] = round((held.value - held_at_kill) * 1000, 1)
    if kill_t is not None and row.get("takeover_quorum_ms") is not None:
        # The standby's own CPU from the kill to the last group it answered.
        until = kill_t + row["takeover_quorum_ms"] / 1000
        used = [cpu for t, cpu in standby_cpu if t <= until]
        row["takeover_cpu_s"] = round(used[-1] - standby_cpu[0][1], 2) if used else None
    if ranks_per_node:  # a group is a node: its requests and bytes are the node's, for its ranks
        row = {"nodes": size, "ranks": size * ranks_per_node, **row}
        row["cpu_core_per_step"] = round(row["cpu_ms_per_step"] / 1000 / step_time, 3)
    return row


def _cpu_trace(pid: int, until: float) -> list[tuple[float, float]]:
    """``pid``'s CPU seconds, sampled every 50 ms from now to ``until``: (time, CPU)."""
    trace = []
    while True:
        now = time.monotonic()
        try:
            trace.append((now, _proc_cpu_s(pid)))
        except (OSError, ValueError):
            break
        if now >= until:
            break
        time.sleep(0.05)
    return trace


def _sleep_until(t: float, held: Any) -> None:
    """Sleeps until ``t`` moved as the groups' schedule was (``held``: it may move meanwhile)."""
    while (left := t + held.value - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def _figures(
    size: int,
    step_time: float,
    results: list[dict[str, Any]],
    cpu_s: float,
    rss: float,
    kill_t: float | None,
    victim: int,
    connect_s: float,
    wall: float,
    t0: float,
    warmup: int = 0,
) -> dict[str, Any]:
    records = [r for res in results for r in res["records"]]
    fast: list[float] = []
    upstream: list[float] = []  # the fast answers that came from the coordinator (not a relay's grant)
    first_epoch = None
    for r in records:
        for step, asked, answered, epoch, _, failed, relayed in r["answers"]:
            if warmup + FAST_STEP <= step < warmup + DISCONNECT_STEP and not failed:
                fast.append(answered - asked)
                if not relayed:
                    upstream.append(answered - asked)
            if step == warmup + 1:
                first_epoch = epoch if first_epoch is None else first_epoch
    fast_bytes = _fast_bytes(records, warmup)
    survivors = [r for r in records if r["replica"] != victim]
    victim_rec = next((r for r in records if r["replica"] == victim), None)
    left = victim_rec["left"] if victim_rec else []
    disconnect_t = left[0] if left else t0 + (warmup + DISCONNECT_STEP) * step_time + step_time / 2
    after = []
    for r in survivors:
        got = [a for a in r["answers"] if a[2] > disconnect_t and a[3] != first_epoch]
        if got:
            after.append(min(a[2] for a in got))
    disconnect_ms = (max(after) - disconnect_t) * 1000 if len(after) == len(survivors) else None
    rejoin_ms = None
    if victim_rec and len(victim_rec["connects"]) >= 2:
        back = victim_rec["connects"][1]
        admitted = [a[2] for a in victim_rec["answers"] if a[2] > back]
        rejoin_ms = (min(admitted) - back) * 1000 if admitted else None
    takeover_ms = takeover_quorum_ms = None
    if kill_t is not None:
        back = [min((t for t in r["connects"] if t > kill_t), default=None) for r in records]
        if all(t is not None for t in back):
            takeover_ms = (max(t for t in back if t is not None) - kill_t) * 1000
        firsts = [min((a[2] for a in r["answers"] if a[2] > kill_t), default=None) for r in records]
        if all(t is not None for t in firsts):
            takeover_quorum_ms = (max(t for t in firsts if t is not None) - kill_t) * 1000
    steps = DISCONNECT_STEP - FAST_STEP
    busiest = max(res["cpu_s"] for res in results)
    return {
        "replica_groups": size,
        "client_procs": len(results),
        "quorum_p50_ms": round(statistics.median(fast) * 1000, 3) if fast else None,
        "quorum_p99_ms": round(_percentile(fast, 0.99) * 1000, 3) if fast else None,
        "fast_answers": len(fast),
        # Answered by the node's relay within a grant (control.grants): a local hop, not the coordinator.
        "relayed_share": round(1 - len(upstream) / len(fast), 3) if fast else None,
        "coordinator_quorum_p99_ms": round(_percentile(upstream, 0.99) * 1000, 3) if upstream else None,
        "disconnect_to_epoch_ms": round(disconnect_ms, 1) if disconnect_ms is not None else None,
        "rejoin_admit_ms": round(rejoin_ms, 1) if rejoin_ms is not None else None,
        "takeover_ms": round(takeover_ms, 1) if takeover_ms is not None else None,
        "takeover_quorum_ms": round(takeover_quorum_ms, 1) if takeover_quorum_ms is not None else None,
        "cpu_ms_per_step": round(cpu_s / steps * 1000, 2),
        "cpu_us_per_request": round(cpu_s / steps / size * 1e6, 1),
        "rss_mib": round(rss, 1),
        "bytes_per_client_step": round(fast_bytes, 1),
        "heartbeat_s": max(r["heartbeat_s"] for r in records),
        "connect_s": round(connect_s, 2),
        "client_cpu_util": round(busiest / wall, 3),
    }


def _fast_bytes(records: list[dict[str, Any]], warmup: int = 0) -> float:
    """Bytes one group receives per fast-path step: the answers' lines, as sent (MAC included)."""
    end, start = warmup + DISCONNECT_STEP, warmup + FAST_STEP
    sizes = [(r["bytes_at"][end] - r["bytes_at"][start]) / (end - start) for r in records if len(r["bytes_at"]) > end]
    return statistics.mean(sizes) if sizes else float("nan")


@click.command()
@click.option(
    "--sizes", default=None, help="Comma-separated replica-group counts [default: 10,100,1000,5000; --quick: 10,100]."
)
@click.option("--quick", is_flag=True, help="Small sizes only (what the test suite runs).")
@click.option("--step-time", type=float, default=1.0, show_default=True, help="Seconds per simulated step.")
@click.option(
    "--jitter",
    type=float,
    default=0.5,
    show_default=True,
    help="Groups ask up to this fraction of a step after it starts (0: every group at the same instant).",
)
@click.option(
    "--client-procs", type=int, default=2, show_default=True, help="Processes the simulated groups are spread over."
)
@click.option(
    "--standby/--no-standby",
    default=True,
    show_default=True,
    help="Run a standby and kill -9 the active one (takeover time).",
)
@click.option(
    "--nodes",
    default=None,
    help="Comma-separated node counts: each node's ranks speak through one connection (its agent's), "
    "one replica group per node; replaces --sizes.",
)
@click.option(
    "--ranks-per-node", type=int, default=8, show_default=True, help="Ranks of each simulated node (with --nodes)."
)
@click.option(
    "--warmup-steps",
    type=int,
    default=None,
    help="Steps before the measured schedule, while the coordinator learns the step time and its grants "
    "settle [default: 10 with --nodes, else 0].",
)
@click.option(
    "--admit-steps",
    type=int,
    default=None,
    help="Steps added between the rejoin and the takeover: a newcomer waits out the steps granted "
    "before it is admitted [default: 8 with --nodes, else 0].",
)
@click.option(
    "--warm-standby/--no-warm-standby",
    default=True,
    show_default=True,
    help="With --nodes: each node keeps an idle connection to the standby, as an agent's relay does.",
)
@click.option(
    "--max-asks-per-s",
    type=float,
    default=None,
    help="The coordinator's --max-asks-per-s (a huge value: no step grants) [default: the coordinator's].",
)
@click.option(
    "--lease-store",
    type=click.Choice(["file", "etcd"]),
    default="file",
    show_default=True,
    help="Where the coordinators keep their lease: the state directory, or a real etcd the bench starts "
    "(Debian's etcd-server, the [etcd] extra).",
)
@click.option("--plot", is_flag=True, help="Also draw the curves (runs/bench/coordinator.png; needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object on stdout.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/coordinator.json"), show_default=True)
def coordinator(
    sizes: str | None,
    quick: bool,
    step_time: float,
    jitter: float,
    client_procs: int,
    standby: bool,
    nodes: str | None,
    ranks_per_node: int,
    warmup_steps: int | None,
    admit_steps: int | None,
    warm_standby: bool,
    max_asks_per_s: float | None,
    lease_store: str,
    plot: bool,
    as_json: bool,
    out: Path,
) -> None:
    """One real coordinator against simulated replica groups: quorum latency, failover, cost per size."""
    if nodes is not None and sizes is not None:
        raise click.UsageError("give --sizes (a connection per group) or --nodes (a connection per node), not both")
    if nodes is not None and not 1 <= ranks_per_node <= 64:
        raise click.UsageError(f"--ranks-per-node must be 1 to 64, got {ranks_per_node}")
    try:
        given = nodes if nodes is not None else sizes
        chosen = tuple(int(s) for s in given.split(",")) if given else QUICK_SIZES if quick else FULL_SIZES
    except ValueError as e:
        raise click.UsageError(f"--sizes / --nodes must be comma-separated integers, got {given!r}") from e
    per_node = ranks_per_node if nodes is not None else 0
    warmup = warmup_steps if warmup_steps is not None else 10 if nodes is not None else 0
    admit = admit_steps if admit_steps is not None else 8 if nodes is not None else 0
    if warmup < 0 or admit < 0 or (max_asks_per_s is not None and not max_asks_per_s > 0):
        raise click.UsageError("--warmup-steps and --admit-steps must be >= 0, --max-asks-per-s > 0")
    if any(s < 2 for s in chosen) or client_procs < 1 or step_time <= 0 or not 0 <= jitter <= 1:
        raise click.UsageError("sizes must be >= 2, --client-procs >= 1, --step-time > 0 and --jitter within 0..1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-coord-") as tmp, contextlib.ExitStack() as stack:
        etcd = None
        if lease_store == "etcd":
            from unbroken.bench.control_plane.lease_filesystems import EtcdServer, missing_tools

            if (why := missing_tools("etcd", fuse=False)) is not None:
                raise click.UsageError(f"--lease-store etcd: {why}")
            etcd = EtcdServer(Path(tmp))
            etcd.start()
            stack.callback(etcd.kill)
        for size in chosen:
            store = "file" if etcd is None else etcd.url.replace("/bench", f"/bench-{size}")
            try:
                row = run_size(
                    size,
                    step_time,
                    jitter,
                    HEARTBEAT_S,
                    client_procs,
                    standby,
                    Path(tmp),
                    per_node,
                    warmup,
                    max_asks_per_s,
                    admit,
                    warm_standby,
                    store,
                )
            except RuntimeError as e:  # this size overwhelmed the machine: said, and the next one runs
                row = {"replica_groups": size, "error": str(e)}
            click.echo(json.dumps(row), err=True)
            rows.append(row)
    result = {
        "step_time_s": step_time,
        "jitter": jitter,
        "ranks_per_node": per_node or None,
        "warmup_steps": warmup,
        "admit_steps": admit,
        "warm_standby": warm_standby and nodes is not None,
        "max_asks_per_s": max_asks_per_s,
        "lease_store": lease_store,
        "load_avg": os.getloadavg()[0],
        "sizes": rows,
    }
    path = publish(result, out, as_json)
    if plot:
        click.echo(f"plot: {_plot(rows, path.with_suffix('.png'))}", err=True)


def _plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    xs = [r["replica_groups"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key in ("quorum_p50_ms", "quorum_p99_ms", "disconnect_to_epoch_ms", "takeover_ms"):
        axes[0].plot(xs, [r[key] for r in rows], marker="o", label=key)
    axes[0].set(xscale="log", yscale="log", xlabel="replica groups", ylabel="ms", title="latency")
    axes[0].legend()
    axes[1].plot(xs, [r["cpu_ms_per_step"] for r in rows], marker="o")
    axes[1].set(xscale="log", yscale="log", xlabel="replica groups", ylabel="coordinator CPU ms / step")
    axes[2].plot(xs, [r["bytes_per_client_step"] for r in rows], marker="o")
    axes[2].set(xscale="log", xlabel="replica groups", ylabel="bytes per group per step")
    fig.tight_layout()
    fig.savefig(path)
    return path
