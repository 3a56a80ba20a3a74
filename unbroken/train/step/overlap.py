"""The layout of an exchanged buffer, and the state of a step's exchange during backward.

Every exchanged buffer ends with :data:`METADATA` slots that each member fills in, so that a
member that silently trains another step, or a miscount of contributors, is caught instead of
averaged in (:func:`fill_buffer`, :func:`contributors`).

:class:`~unbroken.train.ddp.DistributedDataParallel` and
:meth:`~unbroken.train.manager.Manager.process_group` start a step's sums bucket by bucket as
backward produces gradients; :class:`~unbroken.train.manager.Manager` keeps what it needs to
finish, check and, after a failure, redo that step here.
"""

from __future__ import annotations

import dataclasses

import torch

from unbroken.comm.cross_replica import PendingSum
from unbroken.control.quorum.rules import QuorumDecision

METADATA = 3  # slots every exchanged buffer ends with: contributing, step, skipped


def fill_buffer(buf: torch.Tensor, grads: list[torch.Tensor], step: int, zero: bool, skip: bool) -> None:
    """Writes ``grads`` (or zeros when ``zero`` or ``skip``) and this member's metadata into ``buf``.

    ``zero``: a replica catching up sends nothing and counts as no contributor; ``skip``: it sits
    the step out and is counted apart from the contributors.
    """
    n = buf.numel() - METADATA
    if zero or skip:
        buf.zero_()
        if skip:
            buf[n + 2] = 1.0
    else:
        offset = 0
        for g in grads:
            buf[offset : offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        buf[n] = 1.0
        buf[n + 2] = 0.0
    buf[n + 1] = float(step)


def mark_bucket(buf: torch.Tensor, step: int, skip: bool, zero: bool = False) -> None:
    """Writes this member's metadata after a bucket's gradients (zeroing them when it sits out,
    or, ``zero``, when it catches up this step and counts as no contributor)."""
    n = buf.numel() - METADATA
    if skip or zero:
        buf.zero_()
    buf[n] = 0.0 if skip or zero else 1.0
    buf[n + 1] = float(step)
    buf[n + 2] = 1.0 if skip and not zero else 0.0


def contributors(buf: torch.Tensor, decision: QuorumDecision) -> int | None:
    """The replicas whose gradients the summed ``buf`` holds; None when members disagree on the
    step or on who contributes."""
    n = buf.numel() - METADATA
    contributing, step_sum, skipped = buf[n].item(), buf[n + 1].item(), round(buf[n + 2].item())
    if round(contributing) + skipped != decision.contributing or step_sum != float(decision.step) * len(
        decision.members
    ):
        return None
    return round(contributing)


def write_average(grads: list[torch.Tensor], buf: torch.Tensor, contributing: int) -> None:
    """Writes the summed ``buf`` divided by ``contributing`` back into ``grads``, in place."""
    scale = 1.0 / contributing
    offset = 0
    for g in grads:
        torch.mul(buf[offset : offset + g.numel()].view_as(g), scale, out=g)
        offset += g.numel()


@dataclasses.dataclass
class OverlappedExchange:
    """This step's gradient exchange while it runs during backward (``Manager.begin_overlap``).

    Attributes:
        decision: the step's quorum; None when the step exchanges after the backward pass
            instead (a replica catches up this step, or the exchange cannot overlap).
        skip: this replica sits the step out (non-finite loss under ``skip_step``).
        zero: this replica catches up this step: its buckets carry zeros, and it loads its
            donor's state once they are summed (``Manager.catch_up_in_buckets``).
        buffers: the exchanged buffers, each ending with :data:`METADATA` slots.
        pending: their sums in flight.
        failed: a sum failed; the rest of the step's buckets are not started.
        mismatch: members disagreed on a bucket's step or contributors; the step fails once
            every member compared its sums (they all see the same metadata).
        contributing: replicas whose gradients the sums hold, once checked.
        outcome: whether the optimizer may step, once decided.
        waited_s: seconds spent waiting for sums before the end of backward.
        deadline_s: this step's deadline where the learned one does not hold (None: it does).
            In a step where a replica catches up bucket by bucket, the newcomer's first forward
            and backward come before its first bucket: a cold start, not a hang.
        expected: the gradient elements the step's buckets carry in all (``expect_gradients``;
            0: not announced): once that many are summed, the fingerprint swap may start.
    """

    decision: QuorumDecision | None
    step: int = 0
    skip: bool = False
    zero: bool = False
    buffers: list[torch.Tensor] = dataclasses.field(default_factory=list)
    pending: list[PendingSum] = dataclasses.field(default_factory=list)
    failed: bool = False
    mismatch: bool = False
    contributing: int = 0
    outcome: bool | None = None
    waited_s: float = 0.0  # in waits during backward (process_group()): not this rank's compute
    deadline_s: float | None = None
    expected: int = 0

    def all_summed(self) -> bool:
        """Whether every announced gradient element has been summed and nothing is in flight."""
        summed = sum(b.numel() - METADATA for b in self.buffers)
        return self.expected > 0 and not self.pending and summed == self.expected


def busy_seconds(pending: list[PendingSum]) -> float:
    """How long the backend was exchanging ``pending`` (started in order, run one after another)."""
    busy, free_at = 0.0, 0.0
    for p in pending:
        if p.finished is not None:
            begin = max(p.started, free_at)
            busy += max(0.0, p.finished - begin)
            free_at = max(free_at, p.finished)
    return busy
