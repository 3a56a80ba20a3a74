"""Connections derived from job layouts, ring orders and job descriptions."""

from __future__ import annotations

import numpy as np
import pytest

from unbroken.network.topology import Topology
from unbroken.network.traffic import Job, build_traffic, jobs_from_description, parse_hosts, rail_ring


def test_ring_flows_carry_the_ring_volume(fabric: Topology) -> None:
    tr = build_traffic(fabric, [Job("a", (0, 1, 2, 3), tp=8, dp_bytes=1e9)])
    assert len(tr) == 8 * 4  # 8 rings (one per rail) of 4 hosts
    np.testing.assert_allclose(tr.nbytes, 2 * 3 / 4 * 1e9)
    assert all(fabric.locate(s)[1] == fabric.locate(d)[1] for s, d in zip(tr.src, tr.dst, strict=False))


def test_rail_ring_keeps_inter_host_hops_on_one_rail(fabric: Topology) -> None:
    job = Job("b", (3, 0, 6, 1), tp=4, dp_bytes=1e9)
    rank = build_traffic(fabric, [job], ring="rank")
    rail = build_traffic(fabric, [job], ring="rail")

    def cross_rail(tr) -> int:
        return sum(
            fabric.locate(s)[0] != fabric.locate(d)[0] and fabric.locate(s)[1] != fabric.locate(d)[1]
            for s, d in zip(tr.src, tr.dst, strict=False)
        )

    assert cross_rail(rank) > 0
    assert cross_rail(rail) == 0
    assert sorted(rail.rings[(0, 0)]) == sorted(rank.rings[(0, 0)])


def test_rail_ring_groups_hosts_by_leaf(fabric: Topology) -> None:
    members = [fabric.host_gpus(h)[0] for h in (0, 4, 1, 5)]  # leaves b0, b2, b0, b2
    order = [fabric.locate(g)[0] for g in rail_ring(fabric, members)]
    assert order == [0, 1, 4, 5]


def test_pipeline_and_tensor_traffic(fabric: Topology) -> None:
    job = Job("p", (0, 1, 2, 3), tp=8, pp=2, dp_bytes=0, tp_bytes=1e8, pp_bytes=5e7)
    tr = build_traffic(fabric, [job])
    pp = tr.phase == 1
    assert pp.sum() == 2 * 2 * 8  # 2 dp replicas x 8 tp x both directions
    assert (tr.phase == 0).sum() == 4 * 8  # one 8-GPU TP ring per host
    assert not (tr.phase == 2).any()


def test_explicit_ring_order(fabric: Topology) -> None:
    tr = build_traffic(fabric, [Job("a", (0, 1, 2), tp=8, ring=((0, 2, 1),))])
    assert [fabric.locate(g)[0] for g in tr.rings[(0, 0)]] == [0, 2, 1]
    with pytest.raises(ValueError, match="permutation"):
        build_traffic(fabric, [Job("a", (0, 1, 2), tp=8, ring=((0, 0, 1),))])


def test_job_description_parsing(fabric: Topology) -> None:
    jobs = jobs_from_description(
        {
            "jobs": [
                {"name": "x", "hosts": "0-1,4", "tp": "8", "dp_bytes": "2.0e9", "ring": [[2, 1, 0]]},
                {"hosts": {"first": 2, "count": 2, "stride": 3}, "tp": 4},
            ]
        },
        fabric,
    )
    assert jobs[0].hosts == (0, 1, 4) and jobs[0].dp_bytes == 2e9
    assert jobs[0].ring == ((2, 1, 0),)
    assert jobs[1].hosts == (2, 5) and jobs[1].name == "job1"
    assert parse_hosts(["h3", 2], fabric) == (3, 2)


@pytest.mark.parametrize(
    "item, message",
    [
        ({"hosts": "0-1", "tp": 3}, "not divisible"),
        ({"hosts": "0-1", "gpus": 99}, "wants 99 GPUs"),
        ({"hosts": "0-x"}, "ranges like"),
        ({"hosts": "0,0"}, "listed twice"),
        ({"hosts": "0-1", "colour": "red"}, "unknown keys"),
        ({"hosts": "0-1", "dp_bytes": "lots"}, "must be a number"),
        ({"hosts": "0-1", "qps": 0}, "qps must be"),
        ({"hosts": [99]}, "out of range"),
    ],
)
def test_bad_jobs_say_what_to_fix(fabric: Topology, item: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        jobs_from_description({"jobs": [item]}, fabric)


def test_jobs_cannot_share_hosts(fabric: Topology) -> None:
    with pytest.raises(ValueError, match="already used"):
        jobs_from_description({"jobs": [{"hosts": "0-1"}, {"hosts": "1-2"}]}, fabric)
