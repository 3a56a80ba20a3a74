"""Candidate equal-cost paths per connection, as padded arrays of link indices.

Everything downstream (ECMP hashing, spraying, the planner, the exact solver) picks among
these rows, so they are computed once per topology state. Rows are padded with the index
``n_links`` (a virtual link of infinite capacity) so paths of different lengths stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unbroken.network.flowsim import Routing
from unbroken.network.topology import Topology
from unbroken.network.traffic import Traffic

PAD_WIDTH = 8


@dataclass
class Candidates:
    """Per connection a (paths x PAD_WIDTH) array of link indices, padded with ``pad``."""

    paths: list[np.ndarray]
    pad: int

    def routing(self, choice: list[np.ndarray], weight: list[np.ndarray]) -> Routing:
        """Routing where connection c puts ``weight[c][k]`` of its bytes on row ``choice[c][k]``."""
        conn, link, frac = [], [], []
        for c, (rows, w) in enumerate(zip(choice, weight, strict=False)):
            sel = self.paths[c][rows]
            mask = sel != self.pad
            link.append(sel[mask])
            frac.append(np.broadcast_to(np.asarray(w, float)[:, None], sel.shape)[mask])
            conn.append(np.full(int(mask.sum()), c))
        return Routing.from_triplets(
            np.concatenate(conn) if conn else np.zeros(0, int),
            np.concatenate(link) if link else np.zeros(0, int),
            np.concatenate(frac) if frac else np.zeros(0),
            self.pad,
            len(self.paths),
        )


def candidate_paths(topo: Topology, traffic: Traffic) -> Candidates:
    """Equal-cost paths of every connection (alive links only)."""
    pad = topo.n_links
    cache: dict[tuple[int, int], np.ndarray] = {}
    edges = topo.graph.edges

    def build(src: int, dst: int) -> np.ndarray:
        (hs, ls), (hd, ld) = topo.locate(src), topo.locate(dst)
        gs, gd = f"{topo.hosts[hs].name}.g{ls}", f"{topo.hosts[hd].name}.g{ld}"
        if hs == hd:
            nvs = f"{topo.hosts[hs].name}.nvs"
            return _pad(np.array([[edges[gs, nvs]["idx"], edges[nvs, gd]["idx"]]]), pad)
        blocks: list[np.ndarray] = []
        for ps in range(topo.hosts[hs].ports):
            port_s = f"{gs}.p{ps}"
            la = topo.leaf_of(port_s)
            if la is None:
                continue
            for pd in range(topo.hosts[hd].ports):
                port_d = f"{gd}.p{pd}"
                lb = topo.leaf_of(port_d)
                if lb is None or topo.state[edges[lb, port_d]["idx"]] == "down":
                    continue
                mid = topo.leaf_path_links(la, lb)
                if len(mid) == 0:
                    continue
                p = len(mid)
                blocks.append(
                    np.hstack(
                        [np.full((p, 1), edges[port_s, la]["idx"]), mid, np.full((p, 1), edges[lb, port_d]["idx"])]
                    )
                )
        if not blocks:
            raise ValueError(f"no alive path from {gs} to {gd}: the failures disconnect them")
        shortest = min(b.shape[1] for b in blocks)
        return _pad(np.vstack([b for b in blocks if b.shape[1] == shortest]), pad)

    out = []
    for s, d in zip(traffic.src.tolist(), traffic.dst.tolist(), strict=False):
        if (s, d) not in cache:
            cache[(s, d)] = build(s, d)
        out.append(cache[(s, d)])
    return Candidates(out, pad)


def _pad(rows: np.ndarray, pad: int) -> np.ndarray:
    if rows.shape[1] > PAD_WIDTH:
        raise ValueError(f"paths of {rows.shape[1]} links exceed the supported {PAD_WIDTH}")
    out = np.full((rows.shape[0], PAD_WIDTH), pad, dtype=np.int64)
    out[:, : rows.shape[1]] = rows
    return out


def capacity_with_pad(topo: Topology) -> np.ndarray:
    """Link capacities in bytes/s plus the infinite virtual padding link."""
    return np.append(topo.capacity_bytes(), np.inf)
