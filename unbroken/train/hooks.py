"""What the Manager lets be injected into a step: the points where a fault can act.

The Manager calls a :class:`FaultHook` at fixed points of the step when one is given: in a
real job none is, and the step pays nothing. ``unbroken.init()`` installs the one the launcher
planned (:class:`unbroken.faults.worker_chaos.WorkerChaos`); ``train`` itself never imports the
fault-injection package, which sits above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class FaultHook(Protocol):
    """Called by the Manager on the training thread.

    Two more methods are called when the hook has them (a bit flip's means): ``bind_state(fn)``
    once, ``fn()`` returning the replica's registered state; ``after_exchange(step, buf)`` once a
    buffer is summed, before the exchange check fingerprints it.
    """

    def start_step(self, step: int) -> None:
        """A step's compute begins (after the quorum request is sent)."""
        ...

    def before_exchange(self, step: int, members: Sequence[int], nbytes: int, grads: Sequence[Any] = ()) -> None:
        """After the quorum, before each exchange attempt of ``step`` among replicas ``members``
        of ``nbytes`` gradient bytes; ``grads`` (may be empty) are this rank's gradients."""
        ...

    def loss(self, value: float, step: int) -> float:
        """The loss the training loop reports for ``step``, as the fault would make it."""
        ...
