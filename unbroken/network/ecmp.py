"""ECMP as switches do it, and perfect packet spraying as its limit.

At every hop with several equal-cost next hops (the NIC bond choosing a port, a leaf choosing
a spine, a spine choosing a core) the device hashes the 5-tuple with its own seed and takes
``hash mod n``. RoCE fixes every field of the tuple except the UDP source port, which the
library draws per queue pair, so the same hash model also tells the adapter which source port
lands a QP on a planned path. Spraying splits evenly at every hop instead: ECMP with
infinitely many QPs.
"""

from __future__ import annotations

import zlib

import numpy as np

from unbroken.network.flowsim import Routing
from unbroken.network.paths import Candidates
from unbroken.network.topology import Topology
from unbroken.network.traffic import Traffic

ROCE_DPORT = 4791
SPORT_RANGE = (49152, 65536)
_K = [
    np.uint64(k)
    for k in (
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
    )
]


def flow_hash(src: int, dst: int, sport: np.ndarray, seed: int) -> np.ndarray:
    """A 64-bit mix of (src, dst, sport, dport, proto) under a device's seed (vectorised on
    sport)."""
    sport = np.asarray(sport, dtype=np.uint64)
    x = (np.full(sport.shape, src, np.uint64) * _K[0]) ^ (np.full(sport.shape, dst, np.uint64) * _K[1])
    x ^= sport * _K[2]
    x ^= np.full(sport.shape, seed, np.uint64) * _K[3]
    x ^= np.full(sport.shape, ROCE_DPORT * 17, np.uint64)
    x ^= x >> np.uint64(33)
    x *= _K[4]
    x ^= x >> np.uint64(33)
    x *= _K[5]
    x ^= x >> np.uint64(33)
    return x


def device_seeds(topo: Topology) -> np.ndarray:
    """Per link index, the hash seed of the device that forwards onto it (pad gets 0)."""
    return np.array([zlib.crc32(u.encode()) for u, _ in topo.links] + [0], dtype=np.int64)


def hashed_rows(paths: np.ndarray, src: int, dst: int, sports: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """The candidate row each source port lands on after per-hop hashing."""
    out = np.empty(len(sports), dtype=int)
    for i, sport in enumerate(np.asarray(sports)):
        rows = np.arange(len(paths))
        for h in range(paths.shape[1]):
            col = paths[rows, h]
            choices = np.unique(col)
            if len(choices) > 1:
                k = int(flow_hash(src, dst, np.array([sport]), int(seeds[choices[0]]))[0] % np.uint64(len(choices)))
                rows = rows[col == choices[k]]
        out[i] = rows[0]
    return out


def sport_for_row(
    paths: np.ndarray, row: int, src: int, dst: int, seeds: np.ndarray, avoid: set[int] | None = None
) -> int | None:
    """A source port whose hash chain follows candidate ``row``, or None if none exists."""
    sports = np.arange(*SPORT_RANGE, dtype=np.uint64)
    rows = np.arange(len(paths))
    for h in range(paths.shape[1]):
        col = paths[rows, h]
        choices = np.unique(col)
        want = paths[row, h]
        if len(choices) > 1:
            k = int(np.searchsorted(choices, want))
            hit = flow_hash(src, dst, sports, int(seeds[choices[0]])) % np.uint64(len(choices))
            sports = sports[hit == np.uint64(k)]
        rows = rows[col == want]
    for s in sports.tolist():
        if not avoid or int(s) not in avoid:
            return int(s)
    return None


def ecmp_routing(
    cands: Candidates, traffic: Traffic, seeds: np.ndarray, qps: int | None, rng: np.random.Generator
) -> tuple[Routing, list[np.ndarray]]:
    """Routing under ECMP with random source ports.

    Args:
        qps: QPs per connection (bytes split evenly over them); None uses each job's own.

    Returns:
        the routing and, per connection, the chosen candidate rows (one per QP).
    """
    choice, weight = [], []
    for c, paths in enumerate(cands.paths):
        q = qps or traffic.jobs[int(traffic.job[c])].qps
        sports = rng.integers(*SPORT_RANGE, size=q)
        rows = hashed_rows(paths, int(traffic.src[c]), int(traffic.dst[c]), sports, seeds)
        choice.append(rows)
        weight.append(np.full(q, 1.0 / q))
    return cands.routing(choice, weight), choice


def spray_weights(paths: list[np.ndarray]) -> list[np.ndarray]:
    """Per connection, the fraction of its bytes on each candidate row when every hop splits
    evenly over its distinct next links (all connections at once: a row's prefix id starts
    as its connection id and is refined one hop at a time)."""
    if not paths:
        return []
    sizes = [len(p) for p in paths]
    rows = np.vstack(paths)
    prev = np.repeat(np.arange(len(paths)), sizes)
    w = np.ones(len(rows))
    for h in range(rows.shape[1]):
        pairs, cur = np.unique(np.stack([prev, rows[:, h]], axis=1), axis=0, return_inverse=True)
        n_children = np.bincount(pairs[:, 0], minlength=prev.max() + 1)
        w /= n_children[prev]
        prev = cur.ravel()
    return np.split(w, np.cumsum(sizes)[:-1])


def spray_routing(cands: Candidates) -> Routing:
    """Perfect per-hop spraying of every connection over its equal-cost paths."""
    return cands.routing([np.arange(len(p)) for p in cands.paths], spray_weights(cands.paths))
