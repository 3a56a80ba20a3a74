"""Typed reads of the environment: defaults, and errors that name the variable to fix."""

from __future__ import annotations

import pytest

from unbroken import config


def test_switches_are_on_unless_set_to_zero() -> None:
    assert config.prepare_early({}) and config.recorder_enabled({"UNBROKEN_RECORDER": "1"})
    assert not config.prepare_early({"UNBROKEN_PREPARE_EARLY": "0"})
    assert not config.recorder_enabled({"UNBROKEN_RECORDER": "0"})


def test_exchange_mode_is_backend_or_ring() -> None:
    assert config.exchange_mode({}) == "backend"
    assert config.exchange_mode({"UNBROKEN_EXCHANGE": "ring"}) == "ring"
    with pytest.raises(config.ConfigError, match="UNBROKEN_EXCHANGE must be 'backend' or 'ring'"):
        config.exchange_mode({"UNBROKEN_EXCHANGE": "nccl"})


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_connect_timeout_names_the_variable(raw: str) -> None:
    with pytest.raises(config.ConfigError, match="UNBROKEN_CONNECT_TIMEOUT must be a number of seconds > 0"):
        config.connect_timeout_s(60.0, {"UNBROKEN_CONNECT_TIMEOUT": raw})


def test_connect_timeout_from_the_environment_wins_over_the_argument() -> None:
    assert config.connect_timeout_s(60.0, {}) == 60.0
    assert config.connect_timeout_s(60.0, {"UNBROKEN_CONNECT_TIMEOUT": "2.5"}) == 2.5


def test_fault_and_secret_specs_are_none_when_unset_or_blank() -> None:
    assert config.chaos_spec({}) is None and config.link_fault_spec({"UNBROKEN_LINK_FAULT": ""}) is None
    assert config.link_fault_spec({"UNBROKEN_LINK_FAULT": "0-1:stall"}) == "0-1:stall"
    assert config.secret_file({"UNBROKEN_SECRET_FILE": "  "}) is None
    assert config.secret_file({"UNBROKEN_SECRET_FILE": " /s/key "}) == "/s/key"


def test_torchrun_variables() -> None:
    assert config.local_rank({}) == 0 and config.local_rank({"LOCAL_RANK": "3"}) == 3
    with pytest.raises(config.ConfigError, match="LOCAL_RANK must be an integer"):
        config.local_rank({"LOCAL_RANK": "x"})
    assert config.master_address({"MASTER_ADDR": "h"}) is None
    assert config.master_address({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == ("h", "1")
    assert config.omp_num_threads(4, {}) == "4" and config.omp_num_threads(4, {"OMP_NUM_THREADS": "1"}) == "1"


def test_a_rank_listens_on_the_route_to_its_coordinator_not_to_its_node_relay() -> None:
    """A node agent's relay comes first in its ranks' list, on loopback: peers on other nodes
    must dial the route to the coordinator after it (a standby list's first host otherwise)."""
    from unbroken.config import coordinator_host

    assert coordinator_host("127.0.0.1:5000,10.0.0.2:7000") == "10.0.0.2"
    assert coordinator_host("h1:1,h2:2") == "h1"
    assert coordinator_host("localhost:1,node3:2") == "node3"
    assert coordinator_host("127.0.0.1:5000") == "127.0.0.1"  # a job on one machine stays on loopback
