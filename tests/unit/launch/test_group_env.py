from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.launch.agent import AgentSettings
from unbroken.launch.workers import GroupPlace, worker_env


def test_a_rank_of_a_group_spanning_nodes_sees_torchruns_variables_for_the_whole_group() -> None:
    place = GroupPlace(group_rank=1, nodes=2, master_addr="198.18.0.10", master_port=41000, ifname="eth0")
    env = worker_env(
        coordinator="198.18.0.1:29400",
        replica=3,
        num_replicas=4,
        run_dir=Path("run"),
        restarts=0,
        node="h1",
        rank=1,  # the second rank on this node
        world_size=4,
        master_port=1,  # ignored: the group's rank 0 picked its own
        threads=1,
        secret_file=Path("secret"),
        group=place,
    )
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("198.18.0.10", "41000")
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_ranks_that_do_not_split_evenly_over_the_nodes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be a multiple of --nodes-per-replica"):
        AgentSettings(
            command=("python",),
            coordinator="127.0.0.1:1",
            ranks_per_replica=3,
            nodes_per_replica=2,
            secret_file=Path("s"),
        )
    with pytest.raises(ValueError, match="--advertise-addr must be an IP address"):
        AgentSettings(command=("python",), coordinator="127.0.0.1:1", advertise_addr="h0", secret_file=Path("s"))
