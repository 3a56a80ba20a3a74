"""The connections a training step puts on the fabric, derived from each job's parallel layout.

Ranks follow Megatron's order (tensor parallel fastest, then data parallel, then pipeline),
ranks map to the job's GPUs host by host. A ring all-reduce of S bytes over n members makes
every member send 2(n-1)/n * S bytes to its ring successor, so the ring order decides which
GPU pairs talk; that order is an input here (``rank`` as a library would use it, an explicit
list, or ``rail`` for the rail-aligned order the planner proposes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.network.topology import Topology, _read_mapping

PHASES = ("tp", "pp", "dp")


@dataclass(frozen=True)
class Job:
    """One training job: where it runs and how it is split.

    Attributes:
        hosts: host indices in placement order; ranks fill them GPU by GPU.
        gpus: GPUs used (defaults to all GPUs of ``hosts``).
        dp_bytes: bytes each data-parallel group all-reduces per step.
        tp_bytes: bytes each tensor-parallel group all-reduces per step.
        pp_bytes: bytes sent between consecutive pipeline stages per step (each way).
        ring: ``"rank"``, ``"rail"`` or explicit ring orders (lists of dp indices, one list per
            data-parallel group or a single list used for all groups).
        qps: queue pairs per connection the job's collective library opens today.
    """

    name: str
    hosts: tuple[int, ...]
    tp: int = 8
    pp: int = 1
    gpus: int | None = None
    dp_bytes: float = 1e9
    tp_bytes: float = 0.0
    pp_bytes: float = 0.0
    ring: str | tuple[tuple[int, ...], ...] = "rank"
    qps: int = 1


@dataclass
class Traffic:
    """Flows of all jobs as parallel arrays (one entry per connection).

    ``rings[(job, group)]`` keeps each data-parallel ring as GPU ids in ring order, which the
    adapter hands to the collective library.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    job: np.ndarray
    phase: np.ndarray
    jobs: list[Job]
    rings: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def select(self, mask: np.ndarray) -> Traffic:
        return Traffic(
            self.src[mask], self.dst[mask], self.nbytes[mask], self.job[mask], self.phase[mask], self.jobs, self.rings
        )

    def __len__(self) -> int:
        return len(self.src)


def job_gpus(topo: Topology, job: Job) -> list[int]:
    """Global GPU ids of a job in rank order."""
    gpus = [g for h in job.hosts for g in topo.host_gpus(topo.host_index(h))]
    want = job.gpus if job.gpus is not None else len(gpus)
    if want > len(gpus):
        raise ValueError(f"job {job.name}: wants {want} GPUs but its hosts have {len(gpus)}")
    return gpus[:want]


def dp_groups(topo: Topology, job: Job) -> list[list[int]]:
    """Data-parallel groups as GPU ids in dp-index order, one per (pp stage, tp index)."""
    gpus = job_gpus(topo, job)
    dp = _dp_size(job, len(gpus))
    return [[gpus[s * dp * job.tp + d * job.tp + t] for d in range(dp)] for s in range(job.pp) for t in range(job.tp)]


def _dp_size(job: Job, n: int) -> int:
    if job.tp < 1 or job.pp < 1 or n % (job.tp * job.pp):
        raise ValueError(
            f"job {job.name}: {n} GPUs are not divisible by tp*pp = " f"{job.tp}*{job.pp}; change tp, pp or gpus"
        )
    return n // (job.tp * job.pp)


def rail_ring(topo: Topology, members: Sequence[int]) -> list[int]:
    """A ring order that keeps inter-host hops on one rail and inside one leaf where possible.

    Hosts are sorted by the leaf their first member's port 0 hangs off (so hosts under one
    leaf are neighbours), then the ring snakes through the hosts once per local slot: forward
    on the hosts' first GPU, back on their second, and so on. Every inter-host hop then joins
    GPUs of the same local index (the same rail), and direction changes happen over NVLink.
    """
    by_host: dict[int, list[int]] = {}
    for g in members:
        by_host.setdefault(topo.locate(g)[0], []).append(g)

    def key(host: int) -> list[Any]:
        leaf = topo.leaf_of(f"{topo.gpu_name(by_host[host][0])}.p0") or ""
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", leaf)] + [host]

    hosts = sorted(by_host, key=key)
    slots = max(len(v) for v in by_host.values())
    order: list[int] = []
    for k in range(slots):
        seq = hosts if k % 2 == 0 else hosts[::-1]
        order += [sorted(by_host[h])[k] for h in seq if k < len(by_host[h])]
    return order


def build_traffic(topo: Topology, jobs: Sequence[Job], ring: str | None = None) -> Traffic:
    """All connections of all jobs for one training step.

    Args:
        ring: override every job's ring policy (``"rail"`` is what the planner uses).
    """
    cols: list[list[float]] = [[], [], [], [], []]
    rings: dict[tuple[int, int], list[int]] = {}

    def ring_flows(order: list[int], nbytes: float, j: int, phase: str) -> None:
        n = len(order)
        if n < 2 or nbytes <= 0:
            return
        per = 2 * (n - 1) / n * nbytes
        for a, b in zip(order, order[1:] + order[:1], strict=False):
            for c, v in zip(cols, (a, b, per, j, PHASES.index(phase)), strict=False):
                c.append(v)

    for j, job in enumerate(jobs):
        gpus = job_gpus(topo, job)
        dp = _dp_size(job, len(gpus))
        policy = ring or job.ring
        for gi, group in enumerate(dp_groups(topo, job)):
            if policy == "rail":
                order = rail_ring(topo, group)
            elif policy == "rank":
                order = list(group)
            elif isinstance(policy, tuple):
                explicit = policy[gi] if len(policy) > 1 else policy[0]
                if sorted(explicit) != list(range(dp)):
                    raise ValueError(
                        f"job {job.name}: ring {list(explicit)} must be a " f"permutation of the dp indices 0..{dp - 1}"
                    )
                order = [group[d] for d in explicit]
            else:
                raise ValueError(
                    f"job {job.name}: ring must be 'rank', 'rail' or a list of " f"dp-index orders, got {policy!r}"
                )
            rings[(j, gi)] = order
            ring_flows(order, job.dp_bytes, j, "dp")
        for s in range(job.pp):
            for d in range(dp):
                base = s * dp * job.tp + d * job.tp
                ring_flows(gpus[base : base + job.tp], job.tp_bytes, j, "tp")
                if s + 1 < job.pp and job.pp_bytes > 0:
                    for t in range(job.tp):
                        a, b = gpus[base + t], gpus[base + dp * job.tp + t]
                        for pair in ((a, b), (b, a)):
                            for c, v in zip(cols, (*pair, job.pp_bytes, j, 1), strict=False):
                                c.append(v)
    arr = [np.asarray(c) for c in cols]
    return Traffic(
        arr[0].astype(int),
        arr[1].astype(int),
        arr[2].astype(float),
        arr[3].astype(int),
        arr[4].astype(int),
        list(jobs),
        rings,
    )


# --------------------------------------------------------------------- description
def parse_hosts(spec: Any, topo: Topology) -> tuple[int, ...]:
    """Host list from ``"0-31,64-95"``, a list of indices or names, or ``{"first", "count",
    "stride"}``."""
    if isinstance(spec, str):
        out: list[int] = []
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", part)
            if not m:
                raise ValueError(f"hosts {spec!r}: write ranges like '0-31,64-95'")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            out += range(lo, hi + 1)
        hosts = out
    elif isinstance(spec, dict):
        hosts = list(
            range(
                int(spec.get("first", 0)),
                int(spec.get("first", 0)) + int(spec["count"]) * int(spec.get("stride", 1)),
                int(spec.get("stride", 1)),
            )
        )
    elif isinstance(spec, list):
        hosts = [topo.host_index(h) for h in spec]
    else:
        raise ValueError(f"hosts {spec!r}: give a range string, a list or a mapping")
    hosts = [topo.host_index(h) for h in hosts]
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts {spec!r}: a host is listed twice")
    return tuple(hosts)


def jobs_from_description(desc: Any, topo: Topology) -> list[Job]:
    """Jobs from a parsed YAML/JSON ``{"jobs": [...]}`` (or a bare list)."""
    items = desc.get("jobs") if isinstance(desc, dict) else desc
    if not isinstance(items, list) or not items:
        raise ValueError("jobs description must be a non-empty list under 'jobs'")
    jobs: list[Job] = []
    used: dict[int, str] = {}
    known = set(Job.__dataclass_fields__)
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "hosts" not in item:
            raise ValueError(f"job #{i}: needs at least 'hosts'")
        unknown = set(item) - known
        if unknown:
            raise ValueError(f"job #{i}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        kw = dict(item)
        kw["name"] = str(kw.get("name", f"job{i}"))
        kw["hosts"] = parse_hosts(kw["hosts"], topo)
        for key, typ in (
            ("tp", int),
            ("pp", int),
            ("gpus", int),
            ("qps", int),
            ("dp_bytes", float),
            ("tp_bytes", float),
            ("pp_bytes", float),
        ):
            if kw.get(key) is not None:
                try:
                    kw[key] = typ(float(kw[key]))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"job {kw['name']}: {key} must be a number, " f"got {kw[key]!r}") from exc
        ring = kw.get("ring", "rank")
        if isinstance(ring, list):
            kw["ring"] = tuple(
                tuple(int(x) for x in r) for r in (ring if ring and isinstance(ring[0], list) else [ring])
            )
        for h in kw["hosts"]:
            if h in used:
                raise ValueError(f"job {kw['name']}: host {h} is already used by job {used[h]}")
            used[h] = kw["name"]
        job = Job(**kw)
        job_gpus(topo, job)
        _dp_size(job, len(job_gpus(topo, job)))
        if job.qps < 1:
            raise ValueError(f"job {job.name}: qps must be >= 1")
        jobs.append(job)
    return jobs


def load_jobs(path: str | Path, topo: Topology) -> list[Job]:
    return jobs_from_description(_read_mapping(path), topo)
