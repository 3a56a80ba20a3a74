"""Replica groups across hosts, and real network faults, in the cluster box (root needed).

Each test runs one scenario of ``unbroken bench cluster`` in its short form and asserts every
check it makes; the box (namespaces, links, every process in them) is gone afterwards even when
a check fails. The suite runs the node loss of a 2-node replica group; the partitions and the
tbf-slowed link are ``scenario``-marked (``make scenarios``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.cluster import scenarios
from unbroken.cluster.box import Box, nft_path

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("box_available")]


def assert_passed(record: dict[str, object]) -> None:
    failed = [k for k, ok in record["checks"].items() if not ok]  # type: ignore[attr-defined]
    assert not failed, f"{record['scenario']}: failed checks {failed}; record {record}"


def test_the_box_cuts_links_for_real_and_leaves_nothing_behind(tmp_path: Path) -> None:
    with Box(2) as box:
        tag = box.tag
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{tag}-h0" in names and f"{tag}-ctl" in names
        box.cut("h0", "h1")
        with pytest.raises(TimeoutError):
            box.wait_reachable("h0", "h1", 22, timeout=0.5)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert tag not in names and tag not in links


RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 22)  # SO_RCVBUFFORCE (root): no drop of its own
s.bind(("0.0.0.0", 9999))
s.settimeout(1.0)
print("ready", flush=True)
got = 0
try:
    while True:
        s.recv(64)
        got += 1
except TimeoutError:
    print(got)
"""


def test_a_lossy_host_drops_its_packets_in_the_kernel() -> None:
    """``Box.lossy``: an nftables rule in h1's namespace drops the share asked of what reaches
    it (400 datagrams at 30%: 280 expected); gone with ``lossless``."""
    if nft_path() is None:
        pytest.skip("nft (Debian's nftables) is missing: `make nftables` installs it")

    def received(box: Box) -> int:
        rx = subprocess.Popen(
            ["ip", "netns", "exec", box.host("h1").netns, sys.executable, "-c", RECEIVER],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"  # bound before we send
            send = (
                "import socket, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for _ in range(400): s.sendto(b'x', ('{box.host('h1').addr}', 9999)); time.sleep(0.001)"
            )
            subprocess.run(["ip", "netns", "exec", box.host("h0").netns, sys.executable, "-c", send], check=True)
            out, _ = rx.communicate(timeout=10)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        return int(out)

    with Box(2) as box:
        box.lossy("h1", 30.0)
        lossy = received(box)
        box.lossless("h1")
        clean = received(box)
    assert 200 <= lossy <= 350, lossy
    assert clean == 400


def test_node_loss_in_a_two_node_replica_group_restarts_the_group_on_the_spare(tmp_path: Path) -> None:
    assert_passed(scenarios.group_node_loss(tmp_path, quick=True))


@pytest.mark.scenario
def test_a_power_cut_host_s_replica_is_replaced_by_the_hot_spare(tmp_path: Path) -> None:
    assert_passed(scenarios.hot_spare_power_cut(tmp_path, quick=True))


@pytest.mark.scenario
def test_a_host_cut_off_from_everyone_is_evicted_and_catches_up_after_healing(tmp_path: Path) -> None:
    assert_passed(scenarios.partition_host(tmp_path, quick=True))


@pytest.mark.scenario
def test_coordinator_cut_from_a_majority_stops_training_and_loses_no_step(tmp_path: Path) -> None:
    assert_passed(scenarios.coordinator_cut(tmp_path, quick=True, majority=True))


@pytest.mark.scenario
def test_coordinator_cut_from_a_minority_the_majority_trains_on(tmp_path: Path) -> None:
    assert_passed(scenarios.coordinator_cut(tmp_path, quick=True, majority=False))


@pytest.mark.scenario
@pytest.mark.usefixtures("box_available")
def test_the_rendered_kubernetes_pods_survive_a_group_and_a_coordinator_power_cut(tmp_path: Path) -> None:
    """issue 49: the agent and coordinator commands, environment and mounted key file of
    `unbroken k8s render`, run as the pods would run them, one pod per host namespace."""
    assert_passed(scenarios.k8s_pods.kubernetes_pods(tmp_path, quick=True))
