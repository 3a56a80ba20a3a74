"""Max-min fair rates and collective times."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.network.flowsim import Routing, max_min_rates, phase_times
from unbroken.network.planner import plan
from unbroken.network.topology import GBPS_TO_BYTES, rail_optimized
from unbroken.network.traffic import Job


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_ring_time_matches_the_analytical_formula(hosts: int) -> None:
    topo = rail_optimized(8, hosts_per_leaf=2, spines=2, port_gbps=200)
    size = 3e9
    p = plan(topo, [Job("a", tuple(range(hosts)), tp=8, dp_bytes=size)])
    times = phase_times(p.routing(), p.traffic.nbytes, p.traffic.job, topo.capacity_bytes())
    expected = 2 * (hosts - 1) / hosts * size / (200 * GBPS_TO_BYTES)
    assert times[0] == pytest.approx(expected, rel=1e-9)


def test_a_finished_job_frees_bandwidth() -> None:
    # one link of 1 B/s shared by job 0 (1 byte) and job 1 (3 bytes)
    r = Routing.from_triplets(np.array([0, 1]), np.array([0, 0]), np.ones(2), 1, 2)
    times = phase_times(r, np.array([1.0, 3.0]), np.array([0, 1]), np.array([1.0]))
    assert times == {0: pytest.approx(2.0), 1: pytest.approx(4.0)}


def test_dead_link_gives_infinite_time() -> None:
    r = Routing.from_triplets(np.array([0]), np.array([0]), np.ones(1), 1, 1)
    assert phase_times(r, np.array([1.0]), np.array([0]), np.array([0.0])) == {0: np.inf}


@st.composite
def networks(draw):
    n_links = draw(st.integers(1, 6))
    n_flows = draw(st.integers(1, 8))
    cap = np.array(draw(st.lists(st.floats(0.5, 10), min_size=n_links, max_size=n_links)))
    conn, link, frac = [], [], []
    for f in range(n_flows):
        used = draw(st.lists(st.integers(0, n_links - 1), min_size=1, max_size=n_links, unique=True))
        share = draw(st.sampled_from([1.0, 0.5]))
        for e in used:
            conn.append(f)
            link.append(e)
            frac.append(share)
    return Routing.from_triplets(np.array(conn), np.array(link), np.array(frac), n_links, n_flows), cap


@settings(max_examples=150, deadline=None)
@given(networks())
def test_max_min_properties(net) -> None:
    routing, cap = net
    rates = max_min_rates(routing, cap)
    a = routing.matrix.toarray()
    used = a @ rates
    assert np.all(used <= cap * (1 + 1e-7))  # no link over capacity
    saturated = used >= cap * (1 - 1e-7)
    for f in range(a.shape[1]):
        # a flow can only grow by shrinking one no faster than itself: it has a full link on
        # which no other flow is faster
        on = np.flatnonzero((a[:, f] > 0) & saturated)
        assert any(rates[f] >= rates[a[e] > 0].max() * (1 - 1e-7) for e in on), (f, rates)
