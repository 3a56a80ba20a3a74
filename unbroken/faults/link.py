"""Link faults in the ring's transport: a slow or stalled connection between two replicas.

Only the transport knows a link, so this fault acts there: the flight recorder, the ring's
:class:`~unbroken.comm.ring_allreduce.LinkHook`, asks :meth:`LinkFault.delay_s` before each send and holds
the send after it is posted, as a slow wire would (see
:func:`unbroken.comm.ring_allreduce.ring_allreduce_sum`). It needs ``UNBROKEN_EXCHANGE=ring``.
``UNBROKEN_LINK_FAULT="A-B:mb_s=20:step=30"`` slows both directions between replicas A and B
to 20 MB/s from step 30; ``"A-B:stall:step=30"`` stops the transfer A -> B for good;
``"A:mb_s=20:step=30"`` slows every connection of replica A (a slow node).

The schedule's ``slow_link`` (:mod:`unbroken.faults.schedule`) is the coarser cousin: it
delays a whole exchange in the worker, with any transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from unbroken import config
from unbroken.config import ENV_LINK_FAULT


@dataclasses.dataclass(frozen=True)
class LinkFault:
    """A fault on the link between replicas ``a`` and ``b`` (``stall``: only a -> b).

    ``b`` None: every connection of replica ``a`` (a slow node; not with ``stall``).
    """

    a: int
    b: int | None
    step: int = 0
    mb_s: float | None = None
    stall: bool = False

    @classmethod
    def parse(cls, spec: str) -> LinkFault:
        try:
            link, *opts = spec.split(":")
            ends = [int(x) for x in link.split("-")]
            if len(ends) not in (1, 2):
                raise ValueError("the link is A-B (two replicas) or A (all of one replica's links)")
            a, b = ends[0], (ends[1] if len(ends) == 2 else None)
            kw: dict[str, Any] = {}
            for o in opts:
                if o == "stall":
                    kw["stall"] = True
                else:
                    k, v = o.split("=")
                    kw[k] = float(v) if k == "mb_s" else int(v)
            fault = cls(a, b, **kw)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{ENV_LINK_FAULT}={spec!r}: write A-B:mb_s=MB:step=N, A:mb_s=MB:step=N or A-B:stall:step=N ({e})"
            ) from e
        if not fault.stall and not (fault.mb_s and fault.mb_s > 0):
            raise ValueError(f"{ENV_LINK_FAULT}={spec!r}: give mb_s > 0 or stall")
        if fault.stall and fault.b is None:
            raise ValueError(f"{ENV_LINK_FAULT}={spec!r}: a stall names one direction A-B, not a whole replica")
        return fault

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LinkFault | None:
        """The link fault ``UNBROKEN_LINK_FAULT`` asks for, or None."""
        spec = config.link_fault_spec(environ)
        return cls.parse(spec) if spec else None

    def delay_s(self, src: int, dst: int, step: int, nbytes: int) -> float | None:
        """Seconds to hold a send src -> dst (inf: forever), or None when not affected."""
        if step < self.step:
            return None
        if self.stall:
            return float("inf") if (src, dst) == (self.a, self.b) else None
        if {src, dst} == {self.a, self.b} or (self.b is None and self.a in (src, dst)):
            assert self.mb_s is not None  # parse() demands mb_s > 0 without a stall
            return nbytes / (self.mb_s * 1e6)
        return None
