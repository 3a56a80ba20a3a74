"""The traffic planner: a port and a path (and split weights) per connection.

Each phase of a step (TP all-reduces, pipeline sends, DP all-reduces) is balanced on its own,
because its connections are the ones that share links at the same time. A connection's bytes
are placed as units (initially one per NIC port, so dual-port NICs use both ports), greedily,
largest first, each on the candidate path whose most loaded link stays lowest. A local search
then moves units off the most loaded link; when no whole unit can move, the units there are
halved (more QPs on that connection) and the search goes on, until the bottleneck is within
``tol`` of the capacity bound or every split is at ``max_qps``.

On a failure, :func:`replan_local` only moves the units that crossed a failed or degraded link
(seconds matter then); :func:`plan` on the degraded topology is the full re-plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from unbroken.network.bound import cut_bound_s
from unbroken.network.flowsim import Routing
from unbroken.network.paths import Candidates, candidate_paths, capacity_with_pad
from unbroken.network.topology import DOWN, Topology
from unbroken.network.traffic import Job, Traffic, build_traffic

_EPS = 1e-9


@dataclass
class Plan:
    """Units of each connection's bytes placed on its candidate paths.

    Attributes:
        unit_conn, unit_row, unit_size: one entry per unit (a QP's share of a connection).
        bound_s: per phase index, the capacity lower bound on that phase's time.
        plan_s: seconds spent planning.
    """

    topo: Topology
    traffic: Traffic
    cands: Candidates
    unit_conn: np.ndarray
    unit_row: np.ndarray
    unit_size: np.ndarray
    bound_s: dict[int, float] = field(default_factory=dict)
    plan_s: float = 0.0

    def choices(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per connection, the distinct rows used and the fraction of its bytes on each."""
        rows: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        order = np.lexsort((self.unit_row, self.unit_conn))
        conn, row, size = self.unit_conn[order], self.unit_row[order], self.unit_size[order]
        starts = np.searchsorted(conn, np.arange(len(self.cands.paths) + 1))
        for c in range(len(self.cands.paths)):
            r, s = row[starts[c] : starts[c + 1]], size[starts[c] : starts[c + 1]]
            uniq, inv = np.unique(r, return_inverse=True)
            w = np.bincount(inv.ravel(), weights=s)
            rows.append(uniq)
            weights.append(w / w.sum())
        return rows, weights

    def routing(self) -> Routing:
        return self.cands.routing(*self.choices())

    def qps(self) -> np.ndarray:
        """QPs per connection: enough equal QPs to carry each connection's split exactly."""
        q = np.ones(len(self.cands.paths), dtype=int)
        np.maximum.at(q, self.unit_conn, np.rint(self.traffic.nbytes[self.unit_conn] / self.unit_size).astype(int))
        return q


class _Balancer:
    """Greedy placement plus bottleneck-driven local search for one phase."""

    def __init__(self, cands: Candidates, capacity: np.ndarray, nbytes: np.ndarray, max_qps: int) -> None:
        self.paths = cands.paths
        self.cap = capacity
        self.nbytes = nbytes
        self.max_qps = max_qps
        self.load = np.zeros(len(capacity))
        self.conn: list[int] = []
        self.row: list[int] = []
        self.size: list[float] = []
        self.links: list[np.ndarray] = []

    def ratio(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(self.load > 0, self.load / self.cap, 0.0)
        return np.where(np.isnan(r), np.inf, r)

    def best_row(self, c: int, size: float) -> tuple[int, float]:
        p = self.paths[c]
        with np.errstate(divide="ignore", invalid="ignore"):
            r = (self.load[p] + size) / self.cap[p]
        r = np.nan_to_num(r, nan=0.0, posinf=np.inf)
        worst = r.max(axis=1)
        score = worst + 1e-6 * r.sum(axis=1) / p.shape[1]
        i = int(np.argmin(score))
        return i, float(worst[i])

    def add(self, c: int, row: int, size: float) -> None:
        links = self.paths[c][row]
        self.conn.append(c)
        self.row.append(row)
        self.size.append(size)
        self.links.append(links)
        np.add.at(self.load, links, size)

    def place(self, conns: np.ndarray) -> None:
        for c in conns[np.argsort(-self.nbytes[conns], kind="stable")].tolist():
            ports = len(np.unique(self.paths[c][:, 0]))
            for _ in range(ports):
                self.add(c, self.best_row(c, self.nbytes[c] / ports)[0], self.nbytes[c] / ports)

    def improve(self, target: float, movable: set[int] | None = None, max_steps: int = 20000) -> None:
        """Moves (and if needed halves) units off the most loaded link until ``target``."""
        for _ in range(max_steps):
            ratio = self.ratio()
            e = int(np.argmax(ratio))
            top = ratio[e]
            if top <= target * (1 + _EPS):
                return
            ul = np.array(self.links)
            on = np.flatnonzero((ul == e).any(axis=1))
            if movable is not None:
                on = np.array([u for u in on.tolist() if self.conn[u] in movable], dtype=int)
            if len(on) == 0:
                return
            on = on[np.argsort([-self.size[u] for u in on.tolist()], kind="stable")]
            if not self._move_one(on, top) and not self._split_one(on):
                return

    def _move_one(self, units: np.ndarray, top: float) -> bool:
        for u in units.tolist():
            np.subtract.at(self.load, self.links[u], self.size[u])
            row, worst = self.best_row(self.conn[u], self.size[u])
            if worst < top * (1 - 1e-7) and row != self.row[u]:
                self.row[u] = row
                self.links[u] = self.paths[self.conn[u]][row]
                np.add.at(self.load, self.links[u], self.size[u])
                return True
            np.add.at(self.load, self.links[u], self.size[u])
        return False

    def _split_one(self, units: np.ndarray) -> bool:
        for u in units.tolist():
            c = self.conn[u]
            if self.size[u] / 2 >= self.nbytes[c] / self.max_qps * (1 - _EPS) and len(self.paths[c]) > 1:
                self.size[u] /= 2
                np.subtract.at(self.load, self.links[u], self.size[u])
                self.add(c, self.row[u], self.size[u])
                return True
        return False


def plan(topo: Topology, jobs: Sequence[Job], *, ring: str = "rail", max_qps: int = 8, tol: float = 0.005) -> Plan:
    """Plans every connection of every job.

    Args:
        ring: ring order policy for the data-parallel rings (``rail`` reorders them).
        max_qps: most QPs (equal shares) one connection may be split into.
        tol: stop improving a phase once its bottleneck is within this of the bound.
    """
    t0 = time.perf_counter()
    traffic = build_traffic(topo, jobs, ring=ring)
    cands = candidate_paths(topo, traffic)
    p = _balance(topo, traffic, cands, max_qps, tol)
    p.plan_s = time.perf_counter() - t0
    return p


def _balance(topo: Topology, traffic: Traffic, cands: Candidates, max_qps: int, tol: float) -> Plan:
    cap = capacity_with_pad(topo)
    conn_all, row_all, size_all = [], [], []
    bounds: dict[int, float] = {}
    for ph in np.unique(traffic.phase).tolist():
        conns = np.flatnonzero(traffic.phase == ph)
        bal = _Balancer(cands, cap, traffic.nbytes, max_qps)
        bal.place(conns)
        bounds[ph] = cut_bound_s(cands, conns, traffic.nbytes, cap)
        bal.improve(bounds[ph] * (1 + tol))
        conn_all += bal.conn
        row_all += bal.row
        size_all += bal.size
    return Plan(
        topo, traffic, cands, np.array(conn_all, dtype=int), np.array(row_all, dtype=int), np.array(size_all), bounds
    )


def replan_local(old: Plan, topo: Topology, tol: float = 0.005, max_qps: int = 8) -> Plan:
    """Re-weights only the connections that crossed a failed or degraded link.

    Their units are taken off the fabric and put back on the best surviving candidate paths
    (recomputed for a connection that lost all of them); every other connection keeps its
    paths, so only the affected QPs need new source ports.
    """
    t0 = time.perf_counter()
    cap = capacity_with_pad(topo)
    changed = np.flatnonzero(cap[:-1] < capacity_with_pad(old.topo)[:-1])
    dead = set(np.flatnonzero(np.array(topo.state) == DOWN).tolist())
    affected = {
        int(c)
        for c, r in zip(old.unit_conn, old.unit_row, strict=False)
        if np.isin(old.cands.paths[c][r], changed).any()
    }
    paths = list(old.cands.paths)
    remap: dict[int, np.ndarray] = {}
    missing: list[int] = []
    for c, p in enumerate(paths):
        alive = ~np.isin(p, list(dead)).any(axis=1) if dead else np.ones(len(p), bool)
        if alive.all():
            continue
        if alive.any():
            paths[c] = p[alive]
            remap[c] = np.cumsum(alive) - 1
        else:
            missing.append(c)
    if missing:
        fresh = candidate_paths(topo, old.traffic.select(np.array(missing)))
        for c, p in zip(missing, fresh.paths, strict=False):
            paths[c] = p
    cands = Candidates(paths, old.cands.pad)
    out_conn, out_row, out_size = [], [], []
    bounds: dict[int, float] = {}
    for ph in np.unique(old.traffic.phase).tolist():
        conns = np.flatnonzero(old.traffic.phase == ph)
        bal = _Balancer(cands, cap, old.traffic.nbytes, max_qps)
        redo: list[tuple[int, float]] = []
        for u in np.flatnonzero(np.isin(old.unit_conn, conns)).tolist():
            c = int(old.unit_conn[u])
            if c in affected:
                redo.append((c, float(old.unit_size[u])))
            else:
                r = int(old.unit_row[u])
                bal.add(c, int(remap[c][r]) if c in remap else r, float(old.unit_size[u]))
        for c, size in sorted(redo, key=lambda x: -x[1]):
            bal.add(c, bal.best_row(c, size)[0], size)
        bounds[ph] = cut_bound_s(cands, conns, old.traffic.nbytes, cap)
        bal.improve(bounds[ph] * (1 + tol), movable=affected)
        out_conn += bal.conn
        out_row += bal.row
        out_size += bal.size
    return Plan(
        topo,
        old.traffic,
        cands,
        np.array(out_conn, dtype=int),
        np.array(out_row, dtype=int),
        np.array(out_size),
        bounds,
        time.perf_counter() - t0,
    )
