"""The verified exchange: every member's fingerprints of a step's sums, compared before it commits.

:class:`~unbroken.train.step.exchange.GradientExchange` tells an :class:`ExchangeCheck` each buffer it
sends (:meth:`ExchangeCheck.sent`, before the sum starts) and receives
(:meth:`ExchangeCheck.received`, once it is summed); the fingerprints are computed there, on the
buffer's device (:mod:`unbroken.comm.fingerprint`). Once the step's last sum is in,
they are folded into one value each, and the members swap them over the same group: member ``i``
writes its values into its own row as 16-bit pieces (exact in float32, so every transport
carries them unchanged) and zeros elsewhere, and the rows are all-gathered (summed, on a
transport without an all-gather). The swap starts as the last bucket comes in
(:meth:`ExchangeCheck.start`) where each bucket is waited for during backward, else in
:meth:`ExchangeCheck.verify`, which judges it. Every member then holds every member's
fingerprints and reaches the same conclusion
(:mod:`unbroken.train.step.sdc_judge`); a member that may not commit votes no, so its replica does
not apply the step (:mod:`unbroken.train.step.vote`). Every ``weights_every`` steps the member adds a
fingerprint of its parameters and optimizer state, taken as the step begins
(:meth:`ExchangeCheck.note_weights`; else in :meth:`ExchangeCheck.verify`): the state the
optimizer steps from.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unbroken.comm.cross_replica import CrossReplicaGroup, ExchangeFailed, PendingSum
from unbroken.comm.fingerprint import fingerprint as _fingerprint
from unbroken.comm.fingerprint import fold
from unbroken.comm.recorder import FlightRecorder
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.diagnosis.telemetry import SdcFound
from unbroken.train.step.sdc_judge import Attempt, Judgement, Prints, judge

log = logging.getLogger(__name__)

PIECES = 4  # 16-bit pieces of a 64-bit fingerprint
PIECE = 1 << 16
# Per member: the pieces of its input, result and weight fingerprints, then two flags: present
# (1, so a missing or garbled row is seen) and weights checked (1 or 0).
SLOTS = 3 * PIECES + 2
FINDINGS_KEPT = 64  # the last findings a replica keeps (for its report and tests)
SDC_ERROR = "silent data corruption"  # how the failed exchange is reported to the coordinator


@dataclasses.dataclass
class _Swap:
    """A fingerprint swap started as soon as the attempt's last sum was in (:meth:`ExchangeCheck.start`)."""

    epoch: int | None
    step: int
    received: int  # buffers fingerprinted when it started: a later one makes it stale
    mine: Prints
    tensor: torch.Tensor
    pending: PendingSum | None  # None: it failed to start (``error``)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Finding:
    """A verified exchange whose fingerprints differed, as one member saw it."""

    step: int
    epoch: int
    judgement: Judgement
    t: float


def encode(prints: Prints, index: int, members: int, device: torch.device) -> torch.Tensor:
    """The float32 tensor member ``index`` of ``members`` adds to the fingerprint sum."""
    row = [0.0] * (members * SLOTS)
    base = index * SLOTS
    values = (prints.input, prints.result, prints.weights or 0)
    for v_i, value in enumerate(values):
        for p in range(PIECES):
            row[base + v_i * PIECES + p] = float((value >> (16 * p)) & (PIECE - 1))
    row[base + 3 * PIECES] = 1.0
    row[base + 3 * PIECES + 1] = 1.0 if prints.weights is not None else 0.0
    return torch.tensor(row, dtype=torch.float32, device=device)


def decode(summed: Sequence[float], members: Sequence[int]) -> dict[int, Prints] | None:
    """Every member's fingerprints from the summed tensor; None when a row is not one member's
    clean write (the fingerprint sum itself was corrupted, or a member wrote twice or never)."""
    if len(summed) != len(members) * SLOTS:
        return None
    out: dict[int, Prints] = {}
    for i, replica in enumerate(members):
        row = summed[i * SLOTS : (i + 1) * SLOTS]
        if row[3 * PIECES] != 1.0 or row[3 * PIECES + 1] not in (0.0, 1.0):
            return None
        if any(not (0 <= x < PIECE and float(x).is_integer()) for x in row[: 3 * PIECES]):
            return None
        values = [sum(int(row[v * PIECES + p]) << (16 * p) for p in range(PIECES)) for v in range(3)]
        out[replica] = Prints(values[0], values[1], values[2] if row[3 * PIECES + 1] == 1.0 else None)
    return out


class ExchangeCheck:
    """One rank's fingerprints of its exchanges and their comparison with its peers'.

    Args:
        replica_id: this replica.
        weights_every: fingerprint parameters and optimizer state every this many steps (0: never).
        enabled: False turns the whole check off (nothing is fingerprinted or swapped).
        recorder: where a finding goes to the coordinator (an ``sdc_detected`` event, and the
            suspect-hardware rule of the diagnosis); None: only this rank's log.
    """

    def __init__(
        self, replica_id: int, weights_every: int = 0, enabled: bool = True, recorder: FlightRecorder | None = None
    ) -> None:
        if weights_every < 0:
            raise ValueError(f"weights_every must be >= 0 steps (0: never), got {weights_every}")
        self.replica_id = replica_id
        self.recorder = recorder
        self.weights_every = weights_every
        self.enabled = enabled
        self._sent: list[torch.Tensor] = []
        self._received: list[torch.Tensor] = []
        self._layout: list[int] = []
        self._previous: Attempt | None = None
        self.findings: collections.deque[Finding] = collections.deque(maxlen=FINDINGS_KEPT)
        self.detected = 0  # exchanges whose fingerprints differed, as this member saw them
        self.last_result = 0  # the result fingerprint this member committed with (0: not verified)
        # Seconds this rank spent checking (fingerprints, swap, judging) since it began; on a GPU
        # the fingerprints' kernels run on the stream and are counted where they are waited for.
        self.spent_s = 0.0
        # Of those, this thread's CPU seconds (the swap's wait and the backend's own threads left
        # out): on a machine whose cores are all busy, the part that no overlap can hide.
        self.cpu_s = 0.0
        # (epoch, step) of the last swap that completed: every member was past that exchange.
        self.swapped: tuple[int, int] | None = None
        # Weights are compared from this step on: before it, a replica's state may still be one
        # the others' is about to overwrite (torchft's init_sync, at step 0).
        self.weights_from_step = 0
        self._swap: _Swap | None = None
        self._weights: tuple[int, int] | None = None  # (step, fingerprint) taken as the step began
        self.early_swaps = 0  # swaps that began as the last bucket came in (:meth:`start`)

    def completed(self, epoch: int | None, step: int) -> bool:
        """Whether every member of ``epoch`` completed ``step``'s exchange and swapped its
        fingerprints: then no member gave up on that exchange, and an abort of the epoch that
        came after concerns only what follows (:meth:`unbroken.train.manager.Manager._epoch_superseded`)."""
        return self.enabled and epoch is not None and self.swapped == (epoch, step)

    def begin(self) -> None:
        """A new exchange attempt: forgets the buffers of the last one."""
        self.swapped = None
        self.last_result = 0
        self._swap = None
        self._sent.clear()
        self._received.clear()
        self._layout.clear()

    def sent(self, buf: torch.Tensor) -> None:
        """``buf`` is about to be summed: fingerprints what this member sends."""
        if self.enabled:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._sent.append(_fingerprint(buf))
            self._charge(t0, c0)

    def received(self, buf: torch.Tensor) -> None:
        """``buf`` holds its sum: fingerprints what this member received."""
        if self.enabled:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._received.append(_fingerprint(buf))
            self._layout.append(buf.numel())
            self._charge(t0, c0)

    def _charge(self, began: float, cpu_began: float) -> None:
        """Adds the time since ``began`` (perf_counter) and ``cpu_began`` (thread_time) to the
        check's own."""
        self.spent_s += time.perf_counter() - began
        self.cpu_s += time.thread_time() - cpu_began

    def weights_due(self, d: QuorumDecision) -> bool:
        """Whether this step's check includes this member's weights: every ``weights_every``
        steps from ``weights_from_step``, unless it catches up this step (its state is not
        loaded yet)."""
        return (
            self.weights_every > 0
            and d.step % self.weights_every == 0
            and d.step >= self.weights_from_step
            and self.replica_id not in d.behind_set
        )

    def note_weights(self, step: int, weights: Callable[[], int]) -> None:
        """Fingerprints this member's weights as ``step`` begins (before its forward pass), when
        that step may check them, so that its swap can still start as the last bucket comes in.

        Forward and backward change gradients only: the state is the one the optimizer will
        step from, as :meth:`verify` would read it after backward (a flip injected at the step's
        start is in it). Mid-backward, FSDP2's modules may hold unsharded parameters, so without
        this print the weights are read in :meth:`verify`, and that step's swap waits there.
        """
        if not self.enabled or self.weights_every <= 0 or step % self.weights_every or step < self.weights_from_step:
            return
        began, cpu_began = time.perf_counter(), time.thread_time()
        self._weights = (step, weights())
        self._charge(began, cpu_began)

    def _weights_print(self, d: QuorumDecision, weights: Callable[[], int] | None = None) -> int | None:
        """This step's weights' fingerprint where :meth:`weights_due`: the one
        :meth:`note_weights` took as the step began, else ``weights()`` (None without it)."""
        if not self.weights_due(d):
            return None
        if self._weights is not None and self._weights[0] == d.step:
            return self._weights[1]
        return weights() if weights is not None else None

    def start(self, group: CrossReplicaGroup, d: QuorumDecision, device: torch.device) -> None:
        """Starts swapping this attempt's fingerprints now that its last sum is in, so the swap
        travels while this rank ends its backward pass and clips (:meth:`verify` then only
        waits for it). Not when this step's check includes weights that :meth:`note_weights`
        did not fingerprint as the step began: those are read in :meth:`verify`."""
        weights = self._weights_print(d)  # noted as the step began, or None
        if (
            not self.enabled
            or len(d.members) < 2
            or self._swap is not None
            or (self.weights_due(d) and weights is None)
        ):
            return
        began, cpu_began = time.perf_counter(), time.thread_time()
        mine = Prints(fold(self._sent), fold(self._received), weights)
        t = encode(mine, d.members.index(self.replica_id), len(d.members), device)
        try:
            pending = group.start_side_sum(t)
        except ExchangeFailed as e:
            self._swap = _Swap(d.epoch, d.step, len(self._received), mine, t, None, str(e))
        else:
            if pending is not None:
                self._swap = _Swap(d.epoch, d.step, len(self._received), mine, t, pending)
                self.early_swaps += 1
        self._charge(began, cpu_began)

    def verify(
        self,
        group: CrossReplicaGroup,
        deadline_s: float,
        d: QuorumDecision,
        device: torch.device,
        weights: Callable[[], int] | None = None,
    ) -> bool:
        """Swaps this attempt's fingerprints with the members of ``d`` (or finishes the swap
        :meth:`start` began) and judges them; whether this member may commit. False too when the
        swap itself fails (the epoch broke).

        ``weights``: the fingerprint of this member's state, called when :meth:`weights_due`.
        """
        if not self.enabled or len(d.members) < 2:
            return True
        began, cpu_began = time.perf_counter(), time.thread_time()
        swap, self._swap = self._swap, None
        try:
            if swap is not None and (swap.epoch, swap.step) == (d.epoch, d.step):
                if swap.pending is None:
                    raise ExchangeFailed(swap.error)
                group.finish_side_sum(swap.pending, deadline_s)
                if swap.received == len(self._received):
                    mine, t = swap.mine, swap.tensor
                else:  # a bucket came after it (another backward pass): every member swaps again
                    swap = None
            else:
                swap = None
            if swap is None:
                mine = Prints(fold(self._sent), fold(self._received), self._weights_print(d, weights))
                t = encode(mine, d.members.index(self.replica_id), len(d.members), device)
                pending = group.start_side_sum(t)
                if pending is not None:
                    group.finish_side_sum(pending, deadline_s)
                else:  # a transport that sums one at a time (the ring)
                    group.allreduce_sum(t, deadline_s, abortable=False, recorded=False)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: swapping fingerprints failed: %s", self.replica_id, d.step, e)
            self._charge(began, cpu_began)
            return False
        self.swapped = (d.epoch, d.step)
        prints = decode(t.tolist(), d.members)
        layout = tuple(self._layout)
        if prints is None:
            j = Judgement(commit=False, results_differ=True, unresolved=True)
        else:
            j = judge(prints, self.replica_id, layout, self._previous, d.step)
        self._charge(began, cpu_began)
        if j.unresolved and prints is not None:
            self._previous = Attempt(d.step, layout, prints)
        elif not j.unresolved:
            self._previous = None
        if j.detected or j.culprits:
            self._found(d, j)
        if not j.commit:  # what this rank tells the coordinator with its next request
            named = f"replica {', '.join(map(str, j.culprits))}" if j.culprits else "not known yet (a re-run decides)"
            group.last_failure = (d.epoch, f"{SDC_ERROR}: the exchange's sums differ across replicas; culprit {named}")
        if j.commit:  # a committing member's result is the one the majority (or everyone) holds
            self.last_result = mine.result
        return j.commit

    def _found(self, d: QuorumDecision, j: Judgement) -> None:
        if j.detected:
            self.detected += 1
        self.findings.append(Finding(d.step, d.epoch, j, time.time()))
        if self.recorder is not None:
            kind = "results" if j.results_differ else "weights" if j.weights_differ else "rerun"
            self.recorder.note(SdcFound(d.step, d.epoch, kind, list(j.culprits), j.commit))
        what = "the exchange's results" if j.results_differ else "the weights" if j.weights_differ else "first results"
        log.error(
            "replica %d step %d: %s: %s differ across replicas (epoch %d); culprit %s; %s",
            self.replica_id,
            d.step,
            SDC_ERROR,
            what,
            d.epoch,
            list(j.culprits) or "not known yet",
            "committing" if j.commit else "not committing this step",
        )

    def report(self) -> dict[str, Any]:
        """This rank's findings, for a report (JSON)."""
        return {
            "detected": self.detected,
            "early_swaps": self.early_swaps,
            "findings": [
                {
                    "step": f.step,
                    "epoch": f.epoch,
                    "results_differ": f.judgement.results_differ,
                    "weights_differ": f.judgement.weights_differ,
                    "culprits": list(f.judgement.culprits),
                    "committed": f.judgement.commit,
                }
                for f in self.findings
            ],
        }
