"""Which addresses a member's two paths listen on, and the ring of one epoch built from them.

``UNBROKEN_ICCL_PATHS=eth0,eth1`` names the primary and backup interfaces (or their IPv4
addresses); unset, both paths use the address on the route to the store (loopback for a
single-machine job), which still gives two connections per hop but no second NIC.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Any

from unbroken.comm.iccl.faults import CorruptingNic
from unbroken.comm.iccl.ring import IcclRing
from unbroken.config import ConfigError, iccl_corrupt, iccl_paths, iccl_stall_s, local_address_towards
from unbroken.wire.auth import JobSecret

_SIOCGIFADDR = 0x8915


def address_of(spec: str) -> str:
    """``spec`` if it is an IPv4 address, else the IPv4 address of the interface it names."""
    try:
        return str(ipaddress.IPv4Address(spec))
    except ValueError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", spec.encode()[:15]))
    except OSError as e:
        raise ConfigError(
            f"UNBROKEN_ICCL_PATHS names {spec!r}, which is neither an IPv4 address nor an interface "
            f"with one on this host ({e.strerror})"
        ) from None
    return socket.inet_ntoa(packed[20:24])


def local_paths(store_host: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """``((primary_addr, backup_addr), (primary_name, backup_name))`` for this member."""
    configured = iccl_paths()
    if configured is None:
        addr = local_address_towards(store_host)
        return (addr, addr), (addr, addr)
    return (address_of(configured[0]), address_of(configured[1])), configured


def ring_for_epoch(
    secret: JobSecret, rank: int, size: int, store: Any, store_host: str, ring_id: str, timeout_s: float
) -> IcclRing:
    """The ring of one epoch: listens on this member's paths, meets the others in ``store``."""
    addrs, names = local_paths(store_host)
    corrupt = iccl_corrupt()
    return IcclRing.rendezvous(
        secret,
        rank,
        size,
        store,
        addrs,
        timeout_s=timeout_s,
        ring_id=ring_id,
        stall_s=iccl_stall_s(),
        host=f"{socket.gethostname()}/{addrs[0]}",
        interfaces=names,
        fault=_corrupting_nic(corrupt) if corrupt else None,
    )


_NICS: dict[str, CorruptingNic] = {}


def _corrupting_nic(spec: str) -> CorruptingNic:
    """One corrupting NIC per process: its limit counts across the epochs' rings."""
    if spec not in _NICS:
        _NICS[spec] = CorruptingNic.parse(spec)
    return _NICS[spec]
