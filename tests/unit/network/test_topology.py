"""Fabric construction, path enumeration and link state."""

from __future__ import annotations

import json

import pytest

from unbroken.network.topology import DOWN, Topology, from_description, load_topology, rail_optimized


def test_generator_paths_match_the_fabric_shape() -> None:
    topo = rail_optimized(64, ports=2, hosts_per_leaf=4, leaves_per_pod=4, spines=3, core_per_spine=2)
    assert topo.n_gpus == 512
    assert len(topo.gpu_paths(0, 1)) == 1  # NVLink inside a host
    assert len(topo.gpu_paths(0, 8)) == 2  # same leaf, one per plane
    assert len(topo.gpu_paths(0, 8 * 4)) == 2 * 3  # other leaf, same pod: spines
    assert len(topo.gpu_paths(0, 8 * 16)) == 2 * 3 * 2  # other pod: spines x cores
    # a cross-rail pair goes up to a spine even inside one block
    assert all(len(p) == 5 for p in topo.gpu_paths(0, 9))


def test_oversubscription_scales_leaf_uplinks() -> None:
    topo = rail_optimized(8, hosts_per_leaf=4, spines=2, oversubscription=2.0, port_gbps=400)
    up = topo.link_index("leaf.p0.b0.r0", "spine.p0.pod0.s0")
    assert topo.capacity_gbps[up] == pytest.approx(4 * 400 / 2 / 2)


def test_failures_remove_paths_and_degrade_capacity() -> None:
    topo = rail_optimized(8, hosts_per_leaf=2, spines=2)
    link = "leaf.p0.b0.r0:spine.p0.pod0.s0"
    failed = topo.with_failures([link])
    assert len(failed.gpu_paths(0, 16)) == 1
    assert topo.state[topo.link_index("leaf.p0.b0.r0", "spine.p0.pod0.s0")] != DOWN  # copy
    half = topo.with_failures([link + "@0.5"])
    i = topo.link_index("spine.p0.pod0.s0", "leaf.p0.b0.r0")
    assert half.capacity_bytes()[i] == pytest.approx(topo.capacity_bytes()[i] / 2)
    spine_down = topo.with_failures(["spine.p0.pod0.s0"])
    assert all("spine.p0.pod0.s0" not in p for p in spine_down.gpu_paths(0, 16))
    with pytest.raises(ValueError, match="disconnect"):
        topo.with_failures(["spine.p0.pod0.s0", "spine.p0.pod0.s1"]).gpu_paths(0, 16)


def test_explicit_description_from_json(tmp_path) -> None:
    desc = {
        "hosts": [{"name": "a", "gpus": 1}, {"name": "b", "gpus": 1}],
        "switches": [
            {"name": "l0", "tier": 1},
            {"name": "l1", "tier": 1},
            {"name": "s0", "tier": 2},
            {"name": "s1", "tier": 2},
        ],
        "links": [
            ["a.g0.p0", "l0"],
            ["b.g0.p0", "l1"],
            ["l0", "s0", 100],
            ["l0", "s1", 100],
            ["l1", "s0", 100],
            ["l1", "s1", 100],
        ],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(desc))
    topo = load_topology(path)
    assert topo.n_gpus == 2 and len(topo.gpu_paths(0, 1)) == 2


@pytest.mark.parametrize(
    "desc, message",
    [
        ({"generator": "torus"}, "unknown topology generator"),
        ({"generator": "rail_optimized", "hosts": 4, "bogus": 1}, "rail_optimized"),
        ({"generator": "rail_optimized", "hosts": 0}, "hosts must be >= 1"),
        ({"hosts": []}, "lacks"),
        ({"hosts": [{"name": "a"}], "switches": [{"name": "x", "tier": 5}], "links": []}, "tier"),
        ({"hosts": [{"name": "a"}], "switches": [], "links": [["a.g0.p0", "nowhere"]]}, "unknown node"),
        ({"generator": "rail_optimized", "hosts": 2, "failures": ["nowhere"]}, "give a switch name"),
        ({"generator": "rail_optimized", "hosts": 2, "failures": ["h0.g0.p0:leaf.p0.b0.r0@2"]}, "in \\(0, 1\\)"),
    ],
)
def test_bad_descriptions_say_what_to_fix(desc: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_description(desc)


def test_bad_yaml_is_reported(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("hosts: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_topology(path)


def test_gpu_ids_out_of_range() -> None:
    topo: Topology = rail_optimized(2, hosts_per_leaf=2, spines=1)
    with pytest.raises(ValueError, match="out of range"):
        topo.locate(16)
