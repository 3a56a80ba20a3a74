"""A NIC that corrupts what it sends: the fault hook behind ``nic_corrupt`` and the tests.

TCP's own checksum catches what a link flips (and the kernel here has no ``netem`` to flip it),
so bytes are altered where a faulty NIC or DMA engine would: after the sender computed its
CRC-32C, before the wire. The receiver must catch every such chunk and have it resent.
"""

from __future__ import annotations

from unbroken.comm.iccl.monitor import PATH_LOG
from unbroken.config import ConfigError


class CorruptingNic:
    """Flips one byte of every ``every``-th chunk sent, ``limit`` times in all (then none)."""

    def __init__(self, limit: int, every: int = 2) -> None:
        if limit < 0 or every < 1:
            raise ValueError(f"need limit >= 0 and every >= 1, got {limit}, {every}")
        self.limit, self.every, self.count, self._n = limit, every, 0, 0

    def payload(self, seq: int, chunk: int, path: int, data: memoryview) -> memoryview | bytes:
        self._n += 1
        if self.count >= self.limit or self._n % self.every or len(data) == 0:
            return data
        self.count += 1
        PATH_LOG.corrupted_sent += 1
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x40
        return bytes(bad)

    @classmethod
    def parse(cls, spec: str) -> CorruptingNic:
        """``LIMIT[/EVERY]`` (``UNBROKEN_ICCL_CORRUPT``)."""
        limit, _, every = spec.partition("/")
        try:
            return cls(int(limit), int(every or 2))
        except ValueError:
            raise ConfigError(
                f"UNBROKEN_ICCL_CORRUPT must be LIMIT[/EVERY] (chunks; e.g. 400/2), got {spec!r}"
            ) from None
