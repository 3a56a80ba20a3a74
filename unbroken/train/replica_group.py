"""The default process group of a replica's own ranks, on the job's authenticated store.

``init_process_group("gloo")`` with torchrun's variables makes rank 0 host a ``TCPStore`` that
listens on every interface with no authentication: anyone who reaches its port can write the
rendezvous keys of the replica's group. When unbroken creates the group (the script has not),
rank 0 hosts unbroken's :class:`~unbroken.wire.store.StoreServer` instead, bound to
``MASTER_ADDR`` only (the launcher sets loopback: a replica group lives on one node) at
``MASTER_PORT``, and every rank rendezvouses through it with the job's secret.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping

import torch.distributed as dist

from unbroken.comm.store import AuthenticatedStore, StoreError
from unbroken.config import (
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ConfigError,
    ReplicaConfig,
    master_address,
    parse_host_port,
)
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer


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
    dist.init_process_group(backend, store=store, rank=config.rank, world_size=config.world_size)
    return store, server
