"""Exact min-max link load over the candidate paths, for measuring the planner's gap.

The linear program splits each connection's bytes over its candidate paths in any fractions
and minimises the most loaded link's time (bytes / capacity); its optimum is the best any
split routing over these paths can do, so it bounds every planner from below. With
``qps`` set, splits are restricted to multiples of 1/qps (a MILP: what a planner with that
many equal QPs per connection could reach at best). Only small instances are solvable in
seconds; the benchmark runs it up to a few hundred connections.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from unbroken.network.paths import Candidates


def min_max_load_s(
    cands: Candidates,
    conns: np.ndarray,
    nbytes: np.ndarray,
    capacity: np.ndarray,
    qps: int | None = None,
    time_limit_s: float = 60.0,
) -> float:
    """Optimal bottleneck time (s) of the connections ``conns`` run concurrently.

    Args:
        capacity: bytes/s per link (without the padding link).
        qps: None for the fractional optimum, else integer shares of 1/qps per path.

    Raises:
        RuntimeError: the solver did not prove optimality (e.g. time limit hit).
    """
    var_conn, var_row = [], []
    for c in conns.tolist():
        n = len(cands.paths[c])
        var_conn += [c] * n
        var_row += list(range(n))
    nv = len(var_conn)
    var_conn_a = np.array(var_conn)
    # link incidence of every variable (bytes / capacity per unit of share)
    rows_links = np.stack([cands.paths[c][r] for c, r in zip(var_conn, var_row, strict=False)])
    v_idx = np.repeat(np.arange(nv), rows_links.shape[1])
    l_idx = rows_links.ravel()
    keep = l_idx != cands.pad
    v_idx, l_idx = v_idx[keep], l_idx[keep]
    cap = capacity[l_idx]
    dead = np.zeros(nv, bool)
    dead[v_idx[cap <= 0]] = True
    ok = cap > 0
    links, l_pos = np.unique(l_idx[ok], return_inverse=True)
    coef = nbytes[var_conn_a[v_idx[ok]]] / cap[ok]
    a_load = sp.coo_matrix((coef, (l_pos.ravel(), v_idx[ok])), shape=(len(links), nv)).tocsr()
    a_ub = sp.hstack([a_load, -sp.csr_matrix(np.ones((len(links), 1)))]).tocsr()
    _, conn_pos = np.unique(var_conn_a, return_inverse=True)
    a_eq = sp.coo_matrix((np.ones(nv), (conn_pos.ravel(), np.arange(nv))), shape=(len(conns), nv + 1)).tocsr()
    scale = float(qps) if qps else 1.0
    upper = np.where(dead, 0.0, scale)
    c_obj = np.zeros(nv + 1)
    c_obj[-1] = 1.0
    if qps is None:
        res = linprog(
            c_obj,
            A_ub=a_ub,
            b_ub=np.zeros(len(links)),
            A_eq=a_eq,
            b_eq=np.ones(len(conns)),
            bounds=list(zip(np.zeros(nv), upper, strict=False)) + [(0, None)],
            method="highs",
            options={"time_limit": time_limit_s},
        )
        if res.status != 0:
            raise RuntimeError(f"exact LP not solved: {res.message}")
        return float(res.fun)
    a_ub_q = sp.hstack([a_load / scale, -sp.csr_matrix(np.ones((len(links), 1)))]).tocsr()
    res = milp(
        c_obj,
        integrality=np.r_[np.ones(nv), 0],
        bounds=Bounds(np.zeros(nv + 1), np.r_[upper, np.inf]),
        constraints=[LinearConstraint(a_ub_q, -np.inf, 0), LinearConstraint(a_eq, scale, scale)],
        options={"time_limit": time_limit_s},
    )
    if res.status != 0:
        raise RuntimeError(f"exact MILP not solved to optimality: {res.message}")
    return float(res.fun)
