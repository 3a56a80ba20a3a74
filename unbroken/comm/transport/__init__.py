"""The ways an epoch's cross-replica sum is carried, each its own class behind one interface.

:class:`~unbroken.comm.cross_replica.CrossReplicaGroup` owns what every way shares (the epoch,
the bounded waits, the coordinator's abort, the flight record, the reaper); a
:class:`~unbroken.comm.transport.base.Transport` builds each epoch's link, starts a sum on it and
releases it. :func:`make_transport` picks one by the ``UNBROKEN_EXCHANGE`` setting:

- ``backend`` (:class:`BackendTransport`, the default): the all-reduce of a torch NCCL or Gloo
  group, the backend chosen per epoch by :mod:`unbroken.comm.backend`;
- ``ring`` (:class:`RingTransport`): unbroken's CPU-driven ring on such a group, slower but with
  per-connection timings (:mod:`unbroken.comm.ring_allreduce`), so the diagnosis can name a link;
- ``iccl`` (:class:`IcclTransport`): the ICCL ring with a backup connection per hop
  (:mod:`unbroken.comm.iccl`) for CPU tensors; CUDA tensors keep the backend's group.
"""

from __future__ import annotations

from unbroken.comm.transport.backend_transport import BackendTransport
from unbroken.comm.transport.base import EpochLink, Transport
from unbroken.comm.transport.iccl_transport import IcclTransport
from unbroken.comm.transport.ring_transport import RingTransport

TRANSPORTS: dict[str, type[Transport]] = {
    "backend": BackendTransport,
    "ring": RingTransport,
    "iccl": IcclTransport,
}

__all__ = [
    "TRANSPORTS",
    "BackendTransport",
    "EpochLink",
    "IcclTransport",
    "RingTransport",
    "Transport",
    "make_transport",
]


def make_transport(mode: str) -> Transport:
    """The transport of ``mode`` (``UNBROKEN_EXCHANGE``: ``backend``, ``ring`` or ``iccl``)."""
    try:
        return TRANSPORTS[mode]()
    except KeyError:
        raise ValueError(f"the exchange must be one of {', '.join(TRANSPORTS)}, got {mode!r}") from None
