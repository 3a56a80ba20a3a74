"""The worker's settings as one type: what the supervisor writes is what the worker reads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.config import (
    CROSS_REPLICA_BACKENDS,
    ConfigError,
    CrossReplicaBackend,
    GroupPlace,
    ReplicaConfig,
    WorkerSettings,
    cross_replica_backend,
)
from unbroken.launch.node.agent import AgentSettings
from unbroken.launch.run.settings import LaunchSettings


def _settings(tmp_path: Path, **over: object) -> WorkerSettings:
    base: dict[str, object] = dict(
        coordinator="127.0.0.1:29400",
        secret_file=(tmp_path / "secret").resolve(),
        replica=2,
        num_replicas=3,
        run_dir=tmp_path / "run",
        restarts=4,
        node="node0",
        rank=1,
        world_size=2,
        master_port=41000,
        threads=3,
    )
    return WorkerSettings(**{**base, **over})  # type: ignore[arg-type]


def test_what_the_supervisor_writes_the_worker_reads_back(tmp_path: Path) -> None:
    for s in (
        _settings(tmp_path),
        _settings(
            tmp_path,
            cross_replica_backend=CrossReplicaBackend.GLOO,
            checkpoint_dir=tmp_path / "ckpt",
            resume_step=30,
            anomaly_policy="loss_spike=rollback",
            python_path="/shim",
            chaos='{"t0": 1.0, "faults": []}',
            lr_scaling=False,
            replica_groups=5,
        ),
        _settings(tmp_path, world_size=4, master_port=42000, group=GroupPlace(1, 2, "198.18.0.10", 42000, "eth0")),
    ):
        assert WorkerSettings.from_env(s.to_env({})) == s


def test_a_torchft_script_finds_its_group_and_the_groups_of_the_job(tmp_path: Path) -> None:
    """torchft's examples pick their data shard from REPLICA_GROUP_ID of NUM_REPLICA_GROUPS; a
    hot spare's group number is past --replicas, so the count includes the spares."""
    environ = _settings(tmp_path, replica=3, replica_groups=4).to_env({"REPLICA_GROUP_ID": "0"})
    assert (environ["REPLICA_GROUP_ID"], environ["NUM_REPLICA_GROUPS"]) == ("3", "4")
    environ = _settings(tmp_path).to_env({})
    assert (environ["REPLICA_GROUP_ID"], environ["NUM_REPLICA_GROUPS"]) == ("2", "3")


def test_the_worker_reads_where_it_sits_from_what_its_supervisor_wrote(tmp_path: Path) -> None:
    s = _settings(
        tmp_path,
        world_size=4,
        group=GroupPlace(1, 2, "198.18.0.10", 42000),
        checkpoint_dir=tmp_path / "ckpt",
        resume_step=30,
        lr_scaling=False,
    )
    config = ReplicaConfig.from_env(s.to_env({}))
    assert config == s.replica_config()
    assert (config.replica_id, config.num_replicas, config.rank, config.world_size) == (2, 3, 3, 4)
    assert (config.node, config.restart_count, config.resume_step, config.lr_scaling) == ("node0", 4, 30, False)
    assert config.checkpoint_dir == str(tmp_path / "ckpt") and config.run_dir == str(tmp_path / "run")


def test_a_supervised_environment_is_checked_whole(tmp_path: Path) -> None:
    env = _settings(tmp_path).to_env({})
    del env["UNBROKEN_SECRET_FILE"]
    with pytest.raises(ConfigError, match="UNBROKEN_SECRET_FILE is not set"):
        ReplicaConfig.from_env(env)


def test_a_worker_started_by_hand_needs_only_where_to_go() -> None:
    config = ReplicaConfig.from_env(
        {"UNBROKEN_COORDINATOR": "127.0.0.1:29400", "UNBROKEN_REPLICA_ID": "1", "UNBROKEN_NUM_REPLICAS": "2"}
    )
    assert (config.replica_id, config.num_replicas, config.rank, config.world_size) == (1, 2, 0, 1)
    with pytest.raises(ConfigError, match="UNBROKEN_COORDINATOR is not set"):
        ReplicaConfig.from_env({"UNBROKEN_REPLICA_ID": "1"})


def test_a_group_spanning_nodes_gives_torchruns_variables_for_the_whole_group(tmp_path: Path) -> None:
    s = _settings(tmp_path, world_size=4, group=GroupPlace(1, 2, "198.18.0.10", 42000))
    env = s.to_env({})
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("3", "1", "2", "1")
    assert s.global_rank == 3 and (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("198.18.0.10", "42000")


def test_the_users_own_choices_in_the_environment_win(tmp_path: Path) -> None:
    s = _settings(tmp_path, group=GroupPlace(0, 2, "198.18.0.10", 42000, "eth0"), world_size=2, rank=0)
    env = s.to_env({"OMP_NUM_THREADS": "7", "GLOO_SOCKET_IFNAME": "ib0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert (env["OMP_NUM_THREADS"], env["GLOO_SOCKET_IFNAME"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == (
        "7",
        "ib0",
        "1",
    )
    assert "UNBROKEN_CROSS_REPLICA_BACKEND" not in s.to_env({})  # none chosen: the environment's stays


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"num_replicas": 0}, "UNBROKEN_NUM_REPLICAS must be >= 1"),
        ({"replica": -1}, "UNBROKEN_REPLICA_ID must be >= 0"),
        ({"rank": 2}, r"LOCAL_RANK must be in \[0, LOCAL_WORLD_SIZE=2\)"),
        ({"threads": 0}, "OMP_NUM_THREADS must be >= 1"),
        ({"world_size": 3, "group": GroupPlace(0, 2, "198.18.0.10", 1)}, "must be a multiple of GROUP_WORLD_SIZE"),
        ({"resume_step": -1}, "UNBROKEN_RESUME_STEP must be >= 0"),
    ],
)
def test_bad_settings_are_refused_naming_what_to_fix(tmp_path: Path, over: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _settings(tmp_path, **over)


def test_a_worker_environment_missing_or_garbling_a_setting_is_refused_by_name(tmp_path: Path) -> None:
    env = _settings(tmp_path).to_env({})
    del env["UNBROKEN_REPLICA_ID"]
    with pytest.raises(ConfigError, match="UNBROKEN_REPLICA_ID is not set"):
        WorkerSettings.from_env(env)
    env = {**_settings(tmp_path).to_env({}), "UNBROKEN_RESTART_COUNT": "two"}
    with pytest.raises(ConfigError, match="UNBROKEN_RESTART_COUNT must be an integer, got 'two'"):
        WorkerSettings.from_env(env)


def test_the_backend_words_are_declared_once_and_checked_the_same_at_every_door(tmp_path: Path) -> None:
    assert CROSS_REPLICA_BACKENDS == ("auto", "nccl", "gloo")
    assert CrossReplicaBackend.parse("nccl", "x") is CrossReplicaBackend.NCCL
    says = "must be one of auto, nccl, gloo, got 'mpi'"
    with pytest.raises(ConfigError, match="UNBROKEN_CROSS_REPLICA_BACKEND " + says):
        cross_replica_backend({"UNBROKEN_CROSS_REPLICA_BACKEND": "mpi"})
    with pytest.raises(ConfigError, match="UNBROKEN_CROSS_REPLICA_BACKEND " + says):
        WorkerSettings.from_env({**_settings(tmp_path).to_env({}), "UNBROKEN_CROSS_REPLICA_BACKEND": "mpi"})
    with pytest.raises(ValueError, match="--cross-replica-backend " + says):
        LaunchSettings(command=("python",), replicas=1, cross_replica_backend="mpi")
    with pytest.raises(ValueError, match="--cross-replica-backend " + says):
        AgentSettings(
            command=("python",), coordinator="127.0.0.1:1", secret_file=Path("s"), cross_replica_backend="mpi"
        )
    assert cross_replica_backend({}) == "auto"
