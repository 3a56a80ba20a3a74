"""The state of one step's gradient exchange while it runs during the backward pass.

:class:`~unbroken.train.ddp.DistributedDataParallel` and
:meth:`~unbroken.train.manager.Manager.process_group` start a step's sums bucket by bucket as
backward produces gradients; :class:`~unbroken.train.manager.Manager` keeps what it needs to
finish, check and, after a failure, redo that step here.
"""

from __future__ import annotations

import dataclasses

import torch

from unbroken.comm.process_group import PendingSum
from unbroken.control.quorum import QuorumDecision

METADATA = 3  # slots every exchanged buffer ends with: contributing, step, skipped


@dataclasses.dataclass
class OverlappedExchange:
    """This step's gradient exchange while it runs during backward (``Manager.begin_overlap``).

    Attributes:
        decision: the step's quorum; None when the step exchanges after the backward pass
            instead (a replica catches up this step, or the exchange cannot overlap).
        skip: this replica sits the step out (non-finite loss under ``skip_step``).
        buffers: the exchanged buffers, each ending with :data:`METADATA` slots.
        pending: their sums in flight.
        failed: a sum failed; the rest of the step's buckets are not started.
        contributing: replicas whose gradients the sums hold, once checked.
        outcome: whether the optimizer may step, once decided.
        waited_s: seconds spent waiting for sums before the end of backward.
    """

    decision: QuorumDecision | None
    step: int = 0
    skip: bool = False
    buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)
    pending: list[PendingSum] = dataclasses.field(default_factory=list)
    failed: bool = False
    contributing: int = 0
    outcome: bool | None = None
    waited_s: float = 0.0  # in waits during backward (process_group()): not this rank's compute


def busy_seconds(pending: list[PendingSum]) -> float:
    """How long the backend was exchanging ``pending`` (started in order, run one after another)."""
    busy, free_at = 0.0, 0.0
    for p in pending:
        if p.finished is not None:
            begin = max(p.started, free_at)
            busy += max(0.0, p.finished - begin)
            free_at = max(free_at, p.finished)
    return busy
