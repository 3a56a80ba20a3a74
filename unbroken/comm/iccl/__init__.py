"""ICCL in unbroken: a CPU-driven ring all-reduce with a primary and a backup path per hop."""

from unbroken.comm.iccl.conn import Listener, PathAddrs
from unbroken.comm.iccl.ring import IcclRing, IcclWork, RingBroken

__all__ = ["IcclRing", "IcclWork", "Listener", "PathAddrs", "RingBroken"]
