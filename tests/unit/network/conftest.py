"""Small fabrics shared by the network tests."""

from __future__ import annotations

import pytest

from unbroken.network.topology import Topology, rail_optimized
from unbroken.network.traffic import Job


@pytest.fixture
def fabric() -> Topology:
    """8 hosts x 8 GPUs, dual-port, 2 hosts per leaf, 2 spines per plane."""
    return rail_optimized(8, ports=2, hosts_per_leaf=2, spines=2)


@pytest.fixture
def scattered_jobs() -> list[Job]:
    return [Job("a", (0, 5, 2, 7), tp=8, dp_bytes=1e9, qps=1), Job("b", (1, 4, 3, 6), tp=4, dp_bytes=1e9, qps=2)]
