"""ECMP hashing, source-port steering and perfect spraying."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.network.ecmp import device_seeds, ecmp_routing, flow_hash, hashed_rows, sport_for_row, spray_weights
from unbroken.network.paths import candidate_paths
from unbroken.network.topology import Topology, rail_optimized
from unbroken.network.traffic import Job, build_traffic


def test_hash_spreads_source_ports_evenly() -> None:
    h = flow_hash(3, 7, np.arange(49152, 65536), seed=11) % np.uint64(4)
    share = np.bincount(h.astype(int), minlength=4) / len(h)
    assert np.all(np.abs(share - 0.25) < 0.02)
    assert not np.array_equal(h, flow_hash(3, 7, np.arange(49152, 65536), seed=12) % np.uint64(4))


def test_source_port_steers_a_qp_onto_any_candidate_path() -> None:
    topo = rail_optimized(64, ports=2, hosts_per_leaf=4, leaves_per_pod=4, spines=3, core_per_spine=2)
    tr = build_traffic(topo, [Job("a", (0, 20), tp=8)])
    cands = candidate_paths(topo, tr)
    seeds = device_seeds(topo)
    paths = cands.paths[0]
    assert len(paths) == 12
    for row in range(len(paths)):
        sport = sport_for_row(paths, row, int(tr.src[0]), int(tr.dst[0]), seeds)
        assert sport is not None
        assert hashed_rows(paths, int(tr.src[0]), int(tr.dst[0]), np.array([sport]), seeds)[0] == row


def test_ecmp_is_seeded_and_splits_bytes_over_qps(fabric: Topology, scattered_jobs) -> None:
    tr = build_traffic(fabric, scattered_jobs)
    cands = candidate_paths(fabric, tr)
    seeds = device_seeds(fabric)
    r1, rows1 = ecmp_routing(cands, tr, seeds, None, np.random.default_rng(5))
    r2, rows2 = ecmp_routing(cands, tr, seeds, None, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(rows1, rows2, strict=False))
    assert [len(r) for r in rows1] == [j.qps for j in (scattered_jobs[k] for k in tr.job)]
    # each connection's fractions on its first hop add up to one
    for c in range(len(tr)):
        first_hop = np.unique(cands.paths[c][:, 0])
        assert r1.matrix[first_hop].sum(axis=0)[0, c] == pytest.approx(1.0)
    _, rows8 = ecmp_routing(cands, tr, seeds, 8, np.random.default_rng(5))
    assert all(len(r) == 8 for r in rows8)


def test_spray_splits_evenly_per_hop() -> None:
    # two ports; behind port 0 three spines, behind port 1 one spine
    paths = np.array([[0, 10, 20], [0, 11, 21], [0, 12, 22], [1, 13, 23]])
    (w,) = spray_weights([paths])
    np.testing.assert_allclose(w, [1 / 6, 1 / 6, 1 / 6, 1 / 2])
