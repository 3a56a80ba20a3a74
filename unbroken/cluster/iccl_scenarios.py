"""NIC faults on the ICCL exchange in a box whose hosts have two paths (``unbroken bench cluster``).

Every host has ``eth0`` (the primary data plane, 198.18/16) and ``eth1`` (the second plane,
198.19/16). The ring's hops hold a connection on each; the control plane (coordinator, store)
is reached on the second plane, as a management network would be, so that a primary NIC's
fault is only a data-plane fault (a host cut off from the coordinator is ``partition_host``).

* ``nic_failover``: (1) a bare ring of 3 hosts, both planes shaped alike with ``tbf``: h1's
  ``eth0`` goes down in the middle of an all-reduce. The all-reduce in flight must complete with
  the exact sum, its stall (its time less the median) within 1 s, the ring's throughput on the
  backup >= 70% of the primary's; the hop fails back after ``eth0`` returns. (2) a training job
  of 3 replicas on ``UNBROKEN_EXCHANGE=iccl``, the same fault: no eviction, no set-aside, no
  restart; steps go on being committed; replicas identical at the end.
* ``nic_flap``: the job, h1's ``eth0`` down and up every 2 s for 30 s (quick: 10 s): no
  eviction, and the port (h1, eth0, its peer) named within 10 s of the first fault.
* ``nic_corrupt``: the job with every replica's NIC altering one chunk in two after its CRC,
  1,000 chunks in all (quick: 150): every one caught and resent, replicas bitwise identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.cluster.box import Box
from unbroken.cluster.job import BoxJob, JobSpec, consistency, wait_until
from unbroken.cluster.scenarios import CAP, Record, Scenario, _record, _settle, _since
from unbroken.config import ENV_PYTHONPATH, ENV_SECRET_FILE, python_path
from unbroken.observe.events import read_jsonl
from unbroken.wire.auth import JobSecret

ICCL_ENV = {"UNBROKEN_EXCHANGE": "iccl", "UNBROKEN_ICCL_PATHS": "eth0,eth1"}
RING_STORE_PORT = 29600
RATE = "300mbit"  # both planes alike: the backup's bandwidth is compared with the primary's


# -- the bare ring ---------------------------------------------------------------------------


def _ring_rows(run: Path, rank: int) -> list[dict[str, Any]]:
    return list(read_jsonl(run / f"ring-{rank}.jsonl"))


def _start_ring(box: Box, run: Path, hosts: list[str], numel: int, extra_env: dict[str, str] | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    secret = JobSecret.generate().write(run / "ring-secret")
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        ENV_PYTHONPATH: os.pathsep.join(filter(None, [root, python_path()])),
        ENV_SECRET_FILE: str(secret),
        "OMP_NUM_THREADS": "1",
        **ICCL_ENV,
        **(extra_env or {}),
    }
    store = f"{box.host(hosts[0]).addr}:{RING_STORE_PORT}"
    for rank, h in enumerate(hosts):
        argv = [sys.executable, "-m", "unbroken.cluster.iccl_driver", "--rank", str(rank), "--size", str(len(hosts))]
        argv += ["--store", store, "--numel", str(numel), "--out", str(run / f"ring-{rank}.jsonl")]
        argv += ["--stop-file", str(run / "ring-stop")]
        box.spawn(h, argv, run / f"ring-{h}.log", env)


def _stop_ring(box: Box, run: Path, size: int, procs_hosts: list[str]) -> None:
    last = max((r["round"] for k in range(size) for r in _ring_rows(run, k)), default=0)
    (run / "ring-stop").write_text(str(last + 2))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(box.pids(h) for h in procs_hosts):
        time.sleep(0.2)


def ring_failover(root: Path, quick: bool = False) -> dict[str, Any]:
    """Part (1) of ``nic_failover``: the bare ring, its figures and checks."""
    run = root / "nic_failover_ring"
    hosts = ["h0", "h1", "h2"]
    before, during = (6, 6) if quick else (12, 12)
    with Box(3, paths=2) as box:
        for h in hosts:
            for iface in ("eth0", "eth1"):
                box.slow(h, RATE, iface, burst="512kb")
        _start_ring(box, run, hosts, 2_000_000)
        wait_until("the ring to run", lambda: len(_ring_rows(run, 0)) >= before, 180)
        t0 = time.time()
        box.link_down("h1", "eth0")
        wait_until("rounds on the backup", lambda: sum(r["t"] > t0 for r in _ring_rows(run, 0)) >= during, 180)
        box.link_up("h1", "eth0")
        t_up = time.time()
        came_back = True
        try:
            wait_until("the failback", lambda: any(r["failbacks"] for r in _ring_rows(run, 1)), 30)
            n = len(_ring_rows(run, 0))
            wait_until("rounds after the failback", lambda: len(_ring_rows(run, 0)) >= n + 3, 60)
        except TimeoutError:
            came_back = False
        _stop_ring(box, run, 3, hosts)
    rows = [_ring_rows(run, k) for k in range(3)]
    r0 = rows[0]
    primary = [r["s"] for r in r0 if r["t"] + r["s"] < t0][1:]  # the first round builds buffers
    flight = next((r for r in r0 if r["t"] <= t0 < r["t"] + r["s"]), None)
    after = flight["t"] + flight["s"] if flight else t0
    backup = [r["s"] for r in r0 if after <= r["t"] and r["t"] + r["s"] < t_up]
    events = [e for rs in rows for r in rs for e in r["events"]]
    t_failover = min((e["t"] for e in events if e["what"] == "failover" and e["t"] >= t0), default=None)
    p_s = statistics.median(primary) if primary else None
    b_s = statistics.median(backup) if backup else None
    stall = None if flight is None or p_s is None else round(flight["s"] - p_s, 3)
    ratio = None if p_s is None or b_s is None else round(p_s / b_s, 3)
    mb = r0[0]["bytes"] / 1e6 if r0 else 0.0
    checks = {
        "all_sums_exact": all(r["exact"] for rs in rows for r in rs) and all(rs for rs in rows),
        "round_in_flight_completed": flight is not None and flight["exact"],
        "stall_within_1s": stall is not None and stall <= 1.0,
        "backup_bandwidth_at_least_70pct": ratio is not None and ratio >= 0.7,
        "failed_back": came_back,
    }
    return {
        "checks": checks,
        "shaping": f"tbf {RATE} on eth0 and eth1 of every host",
        "allreduce_mb": mb,
        "primary_round_s": p_s,
        "backup_round_s": b_s,
        "backup_bandwidth_ratio": ratio,
        "round_in_flight_s": flight["s"] if flight else None,
        "failover_stall_s": stall,
        "detection_s": _since(t_failover, t0),
        "primary_rounds": len(primary),
        "backup_rounds": len(backup),
    }


# -- the training job ------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    box: Box
    job: BoxJob


@contextlib.contextmanager
def _iccl_job(root: Path, name: str, extra_env: dict[str, str] | None = None) -> Any:
    with Box(3, paths=2) as box:
        spec = JobSpec(
            replicas=3, min_replicas=2, steps=CAP, worker_env={**ICCL_ENV, **(extra_env or {})}, control_plane=1
        )
        job = BoxJob(box, root / name, spec)
        job.start(["h0", "h1", "h2"])
        job.wait_for_step(2, 8, 240)
        yield _Job(box, job)


def _membership(job: BoxJob, t0: float) -> dict[str, Any]:
    ev = job.events()
    evicted = [e for e in ev if e["kind"] == "replica_evicted" and e["t"] >= t0]
    aside = [e for e in ev if e["kind"] == "replica_set_aside" and e["t"] >= t0]
    restarts = sum(len(job.agent_events(h, "replica_restarting")) for h in ("h0", "h1", "h2"))
    return {"evictions": len(evicted), "set_asides": len(aside), "restarts": restarts}


def _iccl_rows(job: BoxJob, replica: int) -> list[dict[str, Any]]:
    return [r for r in job.metrics(replica) if "iccl" in r]


def _committed_between(job: BoxJob, a: float, b: float) -> int:
    return sum(1 for r in job.metrics(0) if r.get("committed") and a <= r["t"] <= b)


def _fault_run(root: Path, name: str, quick: bool, fault: Callable[[Box], float]) -> tuple[BoxJob, dict[str, Any]]:
    tail = 5 if quick else 20
    with _iccl_job(root, name) as j:
        t0 = time.time()
        t_end = fault(j.box)
        _settle(j.job, "a few steps after the fault", lambda: j.job.step_of(0) >= 0, 10, tail)
        codes = j.job.wait_agents(["h0", "h1", "h2"], 120)
    job = j.job
    steps = [r for r in job.metrics(0) if "step_s" in r]
    median = statistics.median(r["step_s"] for r in steps) if steps else None
    around = [r["step_s"] for r in steps if t0 <= r["t"] <= t_end + 2.0]
    inv = consistency(job, [0, 1, 2])
    figures = {
        "t0": t0,
        "agents_finished": all(c == 0 for c in codes.values()),
        "median_step_s": median,
        "max_step_s_during_fault": max(around, default=None),
        "steps_committed_during_fault": _committed_between(job, t0, t_end),
        **_membership(job, t0),
        "inv": inv,
    }
    return job, figures


def _job_checks(f: dict[str, Any]) -> dict[str, bool]:
    inv = f["inv"]
    return {
        "agents_finished": f["agents_finished"],
        "no_eviction": f["evictions"] == 0,
        "no_set_aside": f["set_asides"] == 0,
        "no_restart": f["restarts"] == 0,
        "steps_committed_during_fault": f["steps_committed_during_fault"] > 0,
        **{k: v for k, v in inv.items() if isinstance(v, bool)},
    }


def _port_named(job: BoxJob, t0: float, host_addr: str) -> float | None:
    """When h1's eth0 was first named (a down event on h1's primary path), seconds after ``t0``."""
    for r in _iccl_rows(job, 1):
        for e in r["iccl"]["events"]:
            if e["what"] == "down" and e["interface"] == "eth0" and host_addr in e["host"] and e["t"] >= t0:
                return round(e["t"] - t0, 3)
    return None


def nic_failover(root: Path, quick: bool = False) -> Record:
    ring = ring_failover(root, quick)
    hold = 6.0 if quick else 15.0

    def fault(box: Box) -> float:
        box.link_down("h1", "eth0")
        time.sleep(hold)
        box.link_up("h1", "eth0")
        return time.time()

    job, f = _fault_run(root, "nic_failover_job", quick, fault)
    named = _port_named(job, f["t0"], "198.18.0.11")
    checks = {**{f"ring_{k}": v for k, v in ring.pop("checks").items()}, **_job_checks(f)}
    checks["port_named"] = named is not None
    f.pop("inv")
    return _record("nic_failover", checks, ring=ring, job={k: v for k, v in f.items() if k != "t0"}, port_named_s=named)


def nic_flap(root: Path, quick: bool = False) -> Record:
    span = 10.0 if quick else 30.0

    def fault(box: Box) -> float:
        end = time.time() + span
        while time.time() < end:
            box.link_down("h1", "eth0")
            time.sleep(1.0)
            box.link_up("h1", "eth0")
            time.sleep(1.0)
        return time.time()

    job, f = _fault_run(root, "nic_flap", quick, fault)
    named = _port_named(job, f["t0"], "198.18.0.11")
    downs = sorted(
        e["t"]
        for r in _iccl_rows(job, 1)
        for e in r["iccl"]["events"]
        if e["what"] == "down" and e["interface"] == "eth0" and e["t"] >= f["t0"]
    )
    # The second failure within the window is when the port's finding turns "flapping".
    flapping = round(downs[1] - f["t0"], 3) if len(downs) > 1 else None
    checks = {
        **_job_checks(f),
        "port_named_within_10s": named is not None and named <= 10.0,
        "named_flapping_within_10s": flapping is not None and flapping <= 10.0,
    }
    f.pop("inv")
    return _record(
        "nic_flap",
        checks,
        flap_s=span,
        port_named_s=named,
        flapping_named_s=flapping,
        h1_primary_downs=len(downs),
        job={k: v for k, v in f.items() if k != "t0"},
    )


def ring_corrupt(root: Path, total: int) -> dict[str, Any]:
    """The bare ring with every member's NIC altering one chunk in two (``total`` in all, after
    their CRC): every round's sum is compared, element by element, with the value it must have."""
    run = root / "nic_corrupt_ring"
    hosts = ["h0", "h1", "h2"]
    per = -(-total // 3)
    with Box(3, paths=2) as box:
        # 1M elements, 4 MiB chunks: one chunk a step, 4 a round per member
        _start_ring(box, run, hosts, 1_000_000, {"UNBROKEN_ICCL_CORRUPT": f"{per}/2"})

        def sent() -> int:
            return sum(max((r["corrupted_sent"] for r in _ring_rows(run, k)), default=0) for k in range(3))

        wait_until("the corrupted chunks", lambda: sent() >= 3 * per, 600)
        _stop_ring(box, run, 3, hosts)
    rows = [_ring_rows(run, k) for k in range(3)]
    wrong = sum(1 for rs in rows for r in rs if not r["exact"])
    corrupted = sum(max((r["corrupted_sent"] for r in rs), default=0) for rs in rows)
    caught = sum(max((r["corrupt_chunks"] for r in rs), default=0) for rs in rows)
    return {
        "checks": {"no_wrong_sum": wrong == 0 and all(rows), "all_corrupted_sent": corrupted >= 3 * per},
        "rounds": sum(len(rs) for rs in rows),
        "wrong_sums": wrong,
        "corrupted_chunks_sent": corrupted,
        "caught_by_crc": caught,
    }


def nic_corrupt(root: Path, quick: bool = False) -> Record:
    per_replica = 50 if quick else 340  # 3 replicas: 150 / 1,020 chunks
    tail = 5 if quick else 10
    with _iccl_job(root, "nic_corrupt", {"UNBROKEN_ICCL_CORRUPT": f"{per_replica}/2"}) as j:
        t0 = time.time()

        def sent() -> int:
            return sum(max((r["iccl"]["corrupted_sent"] for r in _iccl_rows(j.job, k)), default=0) for k in range(3))

        try:
            wait_until("the corrupted chunks", lambda: sent() >= 3 * per_replica, 600)
        except TimeoutError:
            pass
        _settle(j.job, "steps after", lambda: True, 1, tail)
        codes = j.job.wait_agents(["h0", "h1", "h2"], 120)
    job = j.job
    corrupted = sum(max((r["iccl"]["corrupted_sent"] for r in _iccl_rows(job, k)), default=0) for k in range(3))
    caught = sum(max((r["iccl"]["corrupt_chunks"] for r in _iccl_rows(job, k)), default=0) for k in range(3))
    inv = consistency(job, [0, 1, 2])
    m = _membership(job, t0)
    ring = ring_corrupt(root, 150 if quick else 1000)
    checks = {
        **{f"ring_{k}": v for k, v in ring.pop("checks").items()},
        "agents_finished": all(c == 0 for c in codes.values()),
        "all_corrupted_chunks_sent": corrupted >= 3 * per_replica,
        "no_eviction": m["evictions"] == 0,
        "no_set_aside": m["set_asides"] == 0,
        **{k: v for k, v in inv.items() if isinstance(v, bool)},
    }
    return _record(
        "nic_corrupt",
        checks,
        corrupted_chunks_sent=corrupted,
        caught_by_crc=caught,
        dropped_unchecked_behind_a_nack=corrupted - caught,
        ring=ring,
        **m,
    )


SCENARIOS = (
    Scenario("nic_failover", nic_failover),
    Scenario("nic_flap", nic_flap),
    Scenario("nic_corrupt", nic_corrupt),
)
