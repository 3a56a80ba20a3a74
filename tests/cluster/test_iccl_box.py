"""Two paths per host in the cluster box, and NIC faults on the ICCL exchange (root needed).

The first test checks the box itself (a second plane; a link fault on one interface leaves the
other working); the ``scenario``-marked ones run ``unbroken bench cluster``'s ``nic_*`` scenarios
in their short form and assert every check they make.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.cluster import iccl_scenarios
from unbroken.cluster.box import Box

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("box_available")]


def assert_passed(record: dict[str, object]) -> None:
    failed = [k for k, ok in record["checks"].items() if not ok]  # type: ignore[attr-defined]
    assert not failed, f"{record['scenario']}: failed checks {failed}; record {record}"


def _ping(box: Box, src: str, addr: str) -> bool:
    """Whether ``addr`` answers from ``src``: a TCP connect to a closed port is refused (an answer)
    when the path works and times out when it does not."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('{addr}', 9), timeout=1).close()\n"
        "except ConnectionRefusedError:\n"
        "    sys.exit(0)\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", box.host(src).netns, sys.executable, "-c", probe], capture_output=True, timeout=30
    )
    return done.returncode == 0


def test_each_host_has_a_second_path_whose_link_fails_on_its_own() -> None:
    with Box(2, paths=2) as box:
        h1 = box.host("h1")
        assert h1.addr2 == "198.19.0.11" and h1.interfaces == ("eth0", "eth1")
        assert _ping(box, "h0", h1.addr) and _ping(box, "h0", h1.addr2)
        box.link_down("h1", "eth0")
        assert not _ping(box, "h0", h1.addr) and _ping(box, "h0", h1.addr2)
        box.link_up("h1", "eth0")
        box.link_down("h1", "eth1")
        assert _ping(box, "h0", h1.addr) and not _ping(box, "h0", h1.addr2)
        with pytest.raises(ValueError, match="no interface 'eth2'"):
            box.link_down("h1", "eth2")
        tag = box.tag
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert tag not in links


def test_one_path_boxes_have_no_second_interface() -> None:
    with Box(1) as box:
        assert box.host("h0").interfaces == ("eth0",)
        with pytest.raises(ValueError, match="no interface 'eth1'"):
            box.link_down("h0", "eth1")


@pytest.mark.scenario
def test_a_primary_nic_lost_mid_allreduce_costs_no_step_and_no_member(tmp_path: Path) -> None:
    assert_passed(iccl_scenarios.nic_failover(tmp_path, quick=True))


@pytest.mark.scenario
def test_a_flapping_nic_is_named_and_costs_no_member(tmp_path: Path) -> None:
    assert_passed(iccl_scenarios.nic_flap(tmp_path, quick=True))


@pytest.mark.scenario
def test_corrupted_chunks_are_resent_never_summed(tmp_path: Path) -> None:
    assert_passed(iccl_scenarios.nic_corrupt(tmp_path, quick=True))
