"""``UNBROKEN_EXCHANGE=iccl``: the ICCL ring (:mod:`unbroken.comm.iccl`) for CPU tensors.

Each epoch gets a ring with a primary and a backup connection per hop, on its own
authenticated sockets; it is closed, not reaped, when its epoch ends (nothing of it lingers).
CUDA tensors keep the backend's group.
"""

from __future__ import annotations

from typing import Any

from unbroken.comm.iccl import IcclRing
from unbroken.comm.iccl.nic_paths import ring_for_epoch
from unbroken.comm.retire import GroupReaper
from unbroken.comm.transport.backend_transport import BackendTransport
from unbroken.comm.transport.base import EpochLink
from unbroken.config import parse_host_port


class IcclTransport(BackendTransport):
    """The ICCL ring on CPU (its ``allreduce`` has the backend's surface), else the backend's."""

    name = "iccl"
    gathers = False  # ICCL's ring carries sums only

    def build(self, link: EpochLink) -> tuple[str, Any]:
        if link.device.type != "cpu":
            return super().build(link)
        host = parse_host_port(link.store_address, "store address")[0]
        ring = ring_for_epoch(link.secret, link.rank, link.size, link.store, host, link.tag_epoch, link.rendezvous_s)
        return "iccl", ring

    def release(self, reaper: GroupReaper, pg: Any, backend: str, epoch: int | None, works: list[Any]) -> None:
        if isinstance(pg, IcclRing):
            pg.close()  # its own threads and sockets: nothing of it lingers or needs keeping
        else:
            super().release(reaper, pg, backend, epoch, works)
