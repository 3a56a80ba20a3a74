"""Max-min fair fluid simulation of collectives on a fabric.

A connection is one flow whose bytes may be split over several paths with fixed fractions
(an ECMP-hashed set of QPs, a planned split, or packet spraying). The routing of all
connections is a sparse links x connections matrix of those fractions, so progressive
filling is a handful of sparse mat-vecs per bottleneck level, fast enough for 4096 GPUs.

A ring step needs every member's chunk, so a collective moves at the pace of its slowest
flow: a job's phase lasts max(bytes / rate) over its flows. Jobs run their phase at the same
time; when one finishes, its flows leave and the others' rates are recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

_REL_EPS = 1e-9


@dataclass
class Routing:
    """Which links each connection uses and with what fraction of its bytes.

    ``matrix[e, c]`` is the fraction of connection c's bytes crossing link e (the fractions
    of one path add to 1 along the path, those of parallel paths add to 1 across them).
    """

    matrix: sp.csr_matrix

    @classmethod
    def from_triplets(cls, conn: np.ndarray, link: np.ndarray, frac: np.ndarray, n_links: int, n_conns: int) -> Routing:
        m = sp.coo_matrix((frac, (link, conn)), shape=(n_links, n_conns)).tocsr()
        m.sum_duplicates()
        return cls(m)

    def loads(self, nbytes: np.ndarray) -> np.ndarray:
        """Bytes crossing each link when every connection sends ``nbytes``."""
        return self.matrix @ nbytes

    def subset(self, conns: np.ndarray) -> Routing:
        return Routing(self.matrix[:, conns].tocsr())


def max_min_rates(routing: Routing, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates (bytes/s) by progressive filling.

    All unfrozen connections grow at the same rate until some link fills; connections that
    cross a full link freeze. A connection that crosses no link (unconstrained) gets ``inf``;
    one that crosses a dead link (capacity 0) gets 0.
    """
    a = routing.matrix
    n = a.shape[1]
    at = a.T.tocsr()
    rates = np.zeros(n)
    frozen = np.asarray(a.getnnz(axis=0) == 0).ravel()
    rates[frozen] = np.inf
    residual = capacity.astype(float).copy()
    tol = _REL_EPS * np.maximum(capacity, 1.0)
    while not frozen.all():
        demand = a @ (~frozen).astype(float)
        live = demand > 0
        inc = float(np.min(residual[live] / demand[live]))
        inc = max(inc, 0.0)
        rates[~frozen] += inc
        residual -= demand * inc
        full = live & (residual <= tol)
        frozen |= (at @ full.astype(float)) > 0
    return rates


def bottleneck_load_s(routing: Routing, nbytes: np.ndarray, capacity: np.ndarray) -> float:
    """Seconds the most loaded link needs for its bytes: a lower bound on the phase time."""
    loads = routing.loads(nbytes)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(loads > 0, loads / capacity, 0.0)
    return float(np.max(t, initial=0.0))


def phase_times(routing: Routing, nbytes: np.ndarray, job: np.ndarray, capacity: np.ndarray) -> dict[int, float]:
    """Completion time of each job's concurrent phase (e.g. every job's DP all-reduce).

    Each job progresses at the pace of its slowest flow under max-min rates; whenever a job
    finishes, the rates of the others are recomputed.

    Returns:
        job id -> seconds from the common start (``inf`` if a flow has no capacity).
    """
    remaining = {int(j): 1.0 for j in np.unique(job)}
    done: dict[int, float] = {}
    now = 0.0
    while remaining:
        active = np.isin(job, list(remaining))
        rates = max_min_rates(routing.subset(np.flatnonzero(active)), capacity)
        full_time: dict[int, float] = {}
        for j in remaining:
            sel = job[active] == j
            with np.errstate(divide="ignore"):
                full_time[j] = float(np.max(nbytes[active][sel] / rates[sel]))
        dt = min(remaining[j] * full_time[j] for j in remaining)
        if not np.isfinite(dt):
            done.update({j: np.inf for j in remaining})
            break
        now += dt
        for j in list(remaining):
            remaining[j] -= dt / full_time[j] if full_time[j] > 0 else remaining[j]
            if remaining[j] <= 1e-9:
                done[j] = now
                del remaining[j]
    return done
