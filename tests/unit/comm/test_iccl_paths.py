"""Where the ICCL paths listen: the settings and their errors."""

from __future__ import annotations

import pytest

from unbroken import config
from unbroken.comm.iccl.nic_paths import address_of


def test_paths_setting_names_primary_and_backup() -> None:
    assert config.iccl_paths({}) is None
    assert config.iccl_paths({"UNBROKEN_ICCL_PATHS": "eth0, eth1"}) == ("eth0", "eth1")
    with pytest.raises(config.ConfigError, match="PRIMARY,BACKUP"):
        config.iccl_paths({"UNBROKEN_ICCL_PATHS": "eth0"})


def test_stall_bound_is_checked() -> None:
    assert config.iccl_stall_s({}) == 0.3
    assert config.iccl_stall_s({"UNBROKEN_ICCL_STALL_S": "0.25"}) == 0.25
    for bad in ("0", "soon", "1e9"):
        with pytest.raises(config.ConfigError, match="UNBROKEN_ICCL_STALL_S"):
            config.iccl_stall_s({"UNBROKEN_ICCL_STALL_S": bad})


def test_exchange_accepts_iccl() -> None:
    assert config.exchange_mode({"UNBROKEN_EXCHANGE": "iccl"}) == "iccl"


def test_an_interface_or_an_address_gives_an_address() -> None:
    assert address_of("lo") == "127.0.0.1"
    assert address_of("127.0.0.2") == "127.0.0.2"
    with pytest.raises(config.ConfigError, match="neither an IPv4 address nor an interface"):
        address_of("nosuchif0")
