"""One attempt at a step's gradient exchange on the epoch's cross-replica group.

:class:`~unbroken.train.manager.Manager` decides which quorum an attempt runs under, whether this
replica contributes, and what a failure means for the step; :class:`GradientExchange` does the
exchange itself: it fills the buffer (or the buckets started during backward) with the
gradients and the metadata of :mod:`unbroken.train.step.overlap`, sums it with the peers under the
learned deadline, checks that every member received the same sum (:mod:`unbroken.train.step.sdc_check`)
and trained the same step, and writes the average back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from unbroken.comm.cross_replica import CrossReplicaGroup, ExchangeFailed
from unbroken.comm.deadline import LearnedDeadline
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.train.step.overlap import (
    METADATA,
    OverlappedExchange,
    busy_seconds,
    contributors,
    fill_buffer,
    mark_bucket,
    write_average,
)
from unbroken.train.step.sdc_check import ExchangeCheck

# Called with (step, buffer) once a buffer is summed, before it is fingerprinted: an injected
# fault's hold on the sum a member received (None in a real job).
ResultHook = Callable[[int, torch.Tensor], None]

log = logging.getLogger(__name__)


class GradientExchange:
    """Sums gradients over the replicas of an epoch; ``stats`` is the Manager's, where the
    exchange's time and wait are written. ``check`` verifies each exchange's sums across the
    members (off: ``ExchangeCheck(..., enabled=False)``); ``weights`` fingerprints this
    replica's state when the check includes it."""

    def __init__(
        self,
        group: CrossReplicaGroup,
        deadline: LearnedDeadline,
        stats: dict[str, float],
        device: torch.device,
        replica_id: int,
        check: ExchangeCheck | None = None,
        weights: Callable[[], int] | None = None,
        on_result: ResultHook | None = None,
    ) -> None:
        self.check = check or ExchangeCheck(replica_id, enabled=False)
        self.weights = weights
        self.on_result = on_result
        self.group = group
        self.deadline = deadline
        self.stats = stats
        self.device = device
        self.replica_id = replica_id
        self._buffer: torch.Tensor | None = None  # reused from step to step while the size holds

    def allreduce(
        self,
        grads: list[torch.Tensor],
        d: QuorumDecision,
        step: int,
        zero: bool,
        skip: bool,
        early: Future[tuple[float, torch.Tensor]] | None = None,
    ) -> bool:
        """Averages ``grads`` in place over the contributors of ``d``; False when it failed.

        ``zero``: this replica is catching up and sends nothing (``early``: the zero exchange it
        began when the quorum answer came); ``skip``: it sits the step out.
        """
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        n = sum(g.numel() for g in locals_)
        self.check.begin()
        if zero and early is not None:
            return self._finish_early(locals_, n, early, d, step)
        buf = self._buffer
        if buf is None or buf.numel() != n + METADATA:
            buf = self._buffer = torch.empty(n + METADATA, dtype=torch.float32, device=self.device)
        # Every member adds its step and whether it contributes, so a member that silently
        # trains a different step is caught instead of averaged in.
        fill_buffer(buf, locals_, d.step, zero=zero, skip=skip)
        self.check.sent(buf)
        try:
            seconds = self.group.allreduce_sum(buf, self.deadline.seconds)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.replica_id, step, e)
            self._buffer = None  # the backend may still write into it
            return False
        return self._apply(locals_, buf, seconds, d)

    def _finish_early(
        self,
        locals_: list[torch.Tensor],
        n: int,
        exchange: Future[tuple[float, torch.Tensor]],
        d: QuorumDecision,
        step: int,
    ) -> bool:
        try:
            seconds, buf = exchange.result()
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.replica_id, step, e)
            return False
        if buf.numel() != n + METADATA:
            raise RuntimeError(
                f"expect_gradients() announced {buf.numel() - METADATA} gradient elements but allreduce() "
                f"got {n}: announce the same parameters the exchange averages (the unbroken wrappers do)"
            )
        self._buffer = buf
        # Not observed by the deadline: it includes the wait for the peers' forward and backward.
        return self._apply(locals_, buf, seconds, d, observe=False)

    def _contributors(self, buf: torch.Tensor, d: QuorumDecision) -> int | None:
        contributing = contributors(buf, d)
        if contributing is None:
            step_sum = buf[buf.numel() - METADATA + 1].item()
            log.warning("replica %d: members disagree on the step (%s); redoing it", self.replica_id, step_sum)
        return contributing

    def _apply(
        self, locals_: list[torch.Tensor], buf: torch.Tensor, seconds: float, d: QuorumDecision, observe: bool = True
    ) -> bool:
        """Checks the exchanged totals and writes the average into the gradients."""
        joined_s = self.group.last_join_wait_s  # before the fingerprint swap, a sum of its own
        if not self._verified([buf], d):
            return False
        contributing = self._contributors(buf, d)
        if contributing is None:
            return False
        if observe:
            self.deadline.observe(seconds)
        self.stats["last_exchange_s"] = seconds
        self.stats["last_join_wait_s"] = joined_s
        if contributing == 0:
            return False  # every replica sat this step out: nothing to apply
        write_average(locals_, buf, contributing)
        return True

    def _verified(self, received: list[torch.Tensor], d: QuorumDecision) -> bool:
        """Fingerprints the summed buffers (after an injected fault's turn) and, when they are the
        attempt's last, compares every member's: whether this member may commit."""
        for buf in received:
            if self.on_result is not None:
                self.on_result(d.step, buf)
            self.check.received(buf)
        return self.check.verify(self.group, self.deadline.seconds, d, self.device, self.weights)

    # -- during backward ---------------------------------------------------------------------

    def start_bucket(self, o: OverlappedExchange, buf: torch.Tensor, step: int, total: int) -> None:
        """Starts summing one bucket of ``o`` (``total``: the bytes of the step's buckets)."""
        assert o.decision is not None
        mark_bucket(buf, o.decision.step, o.skip, o.zero)
        if not o.buffers:
            self.check.begin()
            o.expected = total // 4
        self.check.sent(buf)
        try:
            o.pending.append(self.group.start_allreduce_sum(buf, self._deadline_of(o), total))
            o.buffers.append(buf)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.replica_id, step, e)
            o.failed = True

    def _deadline_of(self, o: OverlappedExchange) -> float:
        return self.deadline.seconds if o.deadline_s is None else max(o.deadline_s, self.deadline.seconds)

    def wait_buckets(self, o: OverlappedExchange, step: int, last: bool) -> bool:
        """Waits for the buckets of ``o`` started so far and checks every member's step and
        contribution, and, at the ``last`` wait, that every member received the same sums;
        False after any failure (``o.failed``)."""
        assert o.decision is not None
        if o.failed:
            return False
        pending, o.pending = o.pending, []
        if not pending:  # all waited for already (process_group()): this only closes the record
            self.group.finish_allreduce_sums([], self._deadline_of(o), last=last)
            return self._verify_buckets(o) if last else True
        waiting = time.perf_counter()
        try:
            seconds = self.group.finish_allreduce_sums(pending, self._deadline_of(o), last=last)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.replica_id, step, e)
            o.failed = True
            return False
        finally:
            o.waited_s += time.perf_counter() - waiting
        for buf in o.buffers[len(o.buffers) - len(pending) :]:
            if self.on_result is not None:
                self.on_result(o.decision.step, buf)
            self.check.received(buf)
            contributing = self._contributors(buf, o.decision)
            if contributing is None:
                o.mismatch = True  # failed once every member compared its sums (all see the same)
            else:
                o.contributing = contributing
        if o.deadline_s is None:  # a newcomer's cold first step teaches nothing about the next ones
            self.deadline.observe(seconds)
        self.stats["last_exchange_s"] = seconds
        self.stats["last_join_wait_s"] = self.group.last_join_wait_s
        self.stats["last_exchange_busy_s"] = busy_seconds(pending)
        if not last and not o.mismatch and o.all_summed():  # the swap travels while backward ends
            self.check.start(self.group, o.decision, self.device)
        return self._verify_buckets(o) if last else not o.mismatch

    def _verify_buckets(self, o: OverlappedExchange) -> bool:
        assert o.decision is not None
        if not self.check.verify(self.group, self._deadline_of(o), o.decision, self.device, self.weights):
            o.failed = True
            return False
        if o.mismatch:
            o.failed = True
            return False
        return True
