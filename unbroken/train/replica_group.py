"""The default process group of a replica's own ranks, on the job's authenticated store.

``init_process_group("gloo")`` with torchrun's variables makes rank 0 host a ``TCPStore`` that
listens on every interface with no authentication: anyone who reaches its port can write the
rendezvous keys of the replica's group. When unbroken creates the group (the script has not),
rank 0 hosts unbroken's :class:`~unbroken.wire.store.StoreServer` instead, bound to
``MASTER_ADDR`` only (the launcher sets loopback: a replica group lives on one node) at
``MASTER_PORT``, and every rank rendezvouses through it with the job's secret.

Gloo's own pairs listen too: on a one-node group (its store on loopback) they listen on the
loopback interface, not on what the host name resolves to (often an address other nodes
reach); a group spanning nodes is pinned to the interface of its node's advertised address by
the launcher (``GLOO_SOCKET_IFNAME``), as is any choice the user made.
"""

from __future__ import annotations

import datetime
import fcntl
import socket
import struct
import time
from collections.abc import Mapping

import torch.distributed as dist

from unbroken.comm.store_client import AuthenticatedStore, StoreError
from unbroken.config import (
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ConfigError,
    ReplicaConfig,
    gloo_interface,
    is_loopback,
    master_address,
    parse_host_port,
)
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

_SIOCGIFFLAGS = 0x8913
_IFF_LOOPBACK = 0x8


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), None if none is found."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if struct.unpack_from("H", raw, 16)[0] & _IFF_LOOPBACK:
            return name
    return None


def gloo_interface_for(store_host: str) -> str | None:
    """Gloo's interface for a group whose store is at ``store_host``: loopback when the store is
    (the group is on one node); None otherwise (the launcher pins a spanning group's)."""
    return loopback_interface() if is_loopback(store_host) else None


def init_gloo_group(
    backend: str, store: dist.Store, rank: int, world_size: int, store_host: str, **kwargs: object
) -> None:
    """``init_process_group`` with Gloo's pairs on loopback when ``store_host`` is (see module doc)."""
    with gloo_interface(gloo_interface_for(store_host) if "gloo" in backend else None):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)  # type: ignore[arg-type]


def rendezvous_store(
    address: str, secret: JobSecret, host_it: bool, timeout_s: float = 60.0
) -> tuple[AuthenticatedStore, StoreServer | None]:
    """A store at ``address`` for a fixed set of processes, hosted by the one with ``host_it``.

    The others wait, up to ``timeout_s``, for the host to listen: processes start in any order.
    """
    host, port = parse_host_port(address, "store address")
    server = StoreServer(host, secret, port=port) if host_it else None
    store = AuthenticatedStore(address, secret, timeout=datetime.timedelta(seconds=timeout_s), connect_timeout_s=5.0)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.check([])  # reachable and authenticated
            return store, server
        except StoreError:
            if time.monotonic() > deadline:
                if server is not None:
                    server.close()
                raise
            time.sleep(0.05)


def replica_store(
    config: ReplicaConfig, secret: JobSecret, timeout_s: float = 60.0, env: Mapping[str, str] | None = None
) -> tuple[AuthenticatedStore, StoreServer | None]:
    """This rank's store for its replica group, and the server when this rank hosts it (rank 0)."""
    master = master_address(env)
    if master is None:
        raise ConfigError(
            f"{ENV_MASTER_ADDR} and {ENV_MASTER_PORT} must be set for a replica of "
            f"{config.world_size} ranks (`unbroken run` and `unbroken agent` set them)"
        )
    address = f"{master[0]}:{master[1]}"
    parse_host_port(address, f"{ENV_MASTER_ADDR}:{ENV_MASTER_PORT}")
    return rendezvous_store(address, secret, config.rank == 0, timeout_s)


def init_replica_group(
    config: ReplicaConfig, secret: JobSecret, backend: str
) -> tuple[AuthenticatedStore, StoreServer | None]:
    """``init_process_group`` over :func:`replica_store`; returns the store and the server rank 0
    hosts. The caller must keep the store: torch holds only its C++ half, and once the Python
    object is collected every later call on the group's store fails ("Not implemented")."""
    store, server = replica_store(config, secret)
    master = master_address()
    assert master is not None  # replica_store checked it
    init_gloo_group(backend, store, config.rank, config.world_size, master[0])
    return store, server
