from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from unbroken.config import GroupPlace, WorkerSettings
from unbroken.launch.node.agent import AgentSettings
from unbroken.launch.workers import interface_of, worker_environ


def environ_of(*, one_machine: bool = False, **settings: Any) -> dict[str, str]:
    return worker_environ(WorkerSettings(**settings), one_machine=one_machine)


def test_a_rank_of_a_group_spanning_nodes_sees_torchruns_variables_for_the_whole_group() -> None:
    place = GroupPlace(group_rank=1, nodes=2, master_addr="198.18.0.10", master_port=41000, ifname="eth0")
    env = environ_of(
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


def _one_machine_env(monkeypatch: pytest.MonkeyPatch, **user: str) -> dict[str, str]:
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    return environ_of(
        coordinator="127.0.0.1:29400",
        replica=0,
        num_replicas=2,
        run_dir=Path("run"),
        restarts=0,
        node="node0",
        rank=0,
        world_size=1,
        master_port=1,
        threads=1,
        secret_file=Path("secret"),
        one_machine=True,
    )


def test_a_one_machine_jobs_workers_bind_nccl_and_gloo_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _one_machine_env(monkeypatch)
    lo = interface_of("127.0.0.1") or "lo"
    assert env["NCCL_SOCKET_IFNAME"] == lo
    assert env["GLOO_SOCKET_IFNAME"] == lo


def test_the_users_choice_of_interface_wins_on_one_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _one_machine_env(monkeypatch, NCCL_SOCKET_IFNAME="ib0", GLOO_SOCKET_IFNAME="eth1")
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("ib0", "eth1")


def test_a_node_of_a_job_spanning_machines_is_not_pinned_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    env = environ_of(
        coordinator="198.18.0.1:29400",
        replica=0,
        num_replicas=2,
        run_dir=Path("run"),
        restarts=0,
        node="h0",
        rank=0,
        world_size=1,
        master_port=1,
        threads=1,
        secret_file=Path("secret"),
    )
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env


def test_unbroken_runs_workers_bind_nccl_to_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.launch.run.launcher import Launcher, LaunchSettings

    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    launcher = Launcher(
        LaunchSettings(command=("true",), replicas=1, ranks_per_replica=1, run_dir=tmp_path / "run", warm_spare=False)
    )
    try:
        r = launcher.replicas[0]
        env = launcher._worker_environ(launcher._worker_settings(r, 0, 1, launcher.placement.home[0]))
    finally:
        launcher.events.close()
    assert env["NCCL_SOCKET_IFNAME"] == (interface_of("127.0.0.1") or "lo")
