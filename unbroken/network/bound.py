"""A capacity lower bound on a phase's time that no routing over the candidate paths can beat.

Every candidate path of a connection crosses exactly one link at each hop position, so all of
its bytes cross the union of the links seen at that position (its NIC ports, its leaf's
uplinks, ...). Connections with the same union share it: their bytes over its capacity bound
the time from below. The bound is what the planner aims for and tells when to stop splitting.
"""

from __future__ import annotations

import numpy as np

from unbroken.network.paths import Candidates


def cut_bound_s(cands: Candidates, conns: np.ndarray, nbytes: np.ndarray, capacity: np.ndarray) -> float:
    """max over link sets of (bytes that must cross the set) / (its capacity), in seconds.

    Args:
        conns: connection indices of the phase (they run concurrently).
        nbytes: bytes per connection (indexed like ``cands.paths``).
        capacity: bytes/s per link, with the padding link last.
    """
    load: dict[frozenset[int], float] = {}
    for c in conns.tolist():
        paths = cands.paths[c]
        for h in range(paths.shape[1]):
            key = frozenset(paths[:, h].tolist())
            if cands.pad in key:
                break
            load[key] = load.get(key, 0.0) + float(nbytes[c])
    best = 0.0
    for key, b in load.items():
        cap = float(capacity[list(key)].sum())
        best = max(best, np.inf if cap <= 0 else b / cap)
    return best
