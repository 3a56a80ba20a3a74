"""The replica step protocol: quorum, reconfigure, catch up, exchange, vote, commit.

One :class:`Manager` per rank. A training loop calls :meth:`start_step` when a step begins
(the quorum request then travels while the forward pass runs) and :meth:`sync_gradients` after
the backward pass; it applies the optimizer step only if that returns True, then calls
:meth:`commit`. The optimizer wrapper in :mod:`unbroken.train.optimizer` does all three, and
:attr:`Manager.last_step_committed` tells the loop whether the step was applied.

What a recovering peer fetches and a checkpoint holds is the dict of every state registered
with :meth:`Manager.register_state_dict_fn` (see :mod:`unbroken.train.state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from unbroken.comm.backend import check_backend
from unbroken.comm.catchup import CatchupServer, SnapshotCopy, fetch_state, snapshot_layout
from unbroken.comm.deadline import LearnedDeadline
from unbroken.comm.process_group import CrossReplicaGroup, ExchangeFailed
from unbroken.comm.recorder import FlightRecorder, LinkDelay
from unbroken.comm.store import AuthenticatedStore
from unbroken.config import (
    ReplicaConfig,
    anomaly_policy,
    local_address_towards,
    prepare_early,
    recorder_enabled,
    run_dir_given,
    stack_signal,
)
from unbroken.config import connect_timeout_s as connect_timeout_from_env
from unbroken.config import cross_replica_backend as env_cross_replica_backend
from unbroken.control.client import CoordinatorClient
from unbroken.control.quorum import QuorumDecision
from unbroken.diagnosis.metrics import parse_policy, wants_skip
from unbroken.diagnosis.stack_dump import install_stack_dump
from unbroken.diagnosis.stacks import stack_path
from unbroken.diagnosis.telemetry import CaughtUp
from unbroken.train.hooks import FaultHook
from unbroken.train.overlap import METADATA, OverlappedExchange, busy_seconds
from unbroken.train.replica_group import init_replica_group
from unbroken.train.state import LoadStateDictFn, StateDictFn, as_local, as_shards
from unbroken.wire.auth import JobSecret
from unbroken.wire.store import StoreServer

log = logging.getLogger(__name__)
T = TypeVar("T")

LEGACY_STATE_KEY = "state"  # where init(state_dict=..., load_state_dict=...) registers its pair
DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_QUORUM_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0
# How long leaving the job waits for the epoch groups to be released (a Gloo group whose peer is
# gone releases in milliseconds; one with a stuck operation is kept, never destroyed, at exit).
SHUTDOWN_RELEASE_S = 3.0


class Manager:
    """Runs this rank's side of the fault-tolerant step protocol.

    A context manager: ``with unbroken.init() as manager:`` leaves the job cleanly at the end
    (a finished replica) and, on an exception, as a failed one, whose restart the supervisor
    decides.

    Args:
        state_dict, load_state_dict: a convenience for one state, registered under the key
            ``"state"``; :meth:`register_state_dict_fn` registers any number, at any time.
        config: where this rank sits; read from the environment when omitted.
        device: where gradients live (CPU: the exchange runs on Gloo; CUDA: see
            ``cross_replica_backend``).
        cross_replica_backend: ``auto`` (NCCL when every member of an epoch holds a distinct
            GPU, else Gloo carrying the CUDA tensors), ``nccl`` or ``gloo``; None reads
            ``UNBROKEN_CROSS_REPLICA_BACKEND`` (``unbroken run --cross-replica-backend``).
        deadline: how long an exchange may take before a peer is presumed hung.
        max_attempts: exchange attempts per step before the step is given up.
        quorum_timeout_s: how long to wait for a quorum (training waits while fewer than
            ``min_replicas`` are alive).

    Attributes:
        step: the number of steps this replica has committed (the job's step).
        last_step_committed: whether the step begun by the last :meth:`start_step` was applied:
            False from :meth:`start_step` (``optimizer.zero_grad()``) until :meth:`commit`. After
            ``optimizer.step()`` it says whether the optimizer really stepped; a step that failed
            (a peer died mid-exchange, every replica sat it out) leaves ``step`` where it was.

    Thread model (docs/architecture.md, "Threads of a replica process"). Every public method
    runs on the training thread, which owns the step's state (``step``, ``decision``,
    ``stats``, ``_quorum``, ``_buffer``, ``_overlap``, ``_snapshot``, ``_metrics``, the state
    functions). Other threads touch only:

    - ``unbroken-coordinator`` (the client's connection thread) runs :meth:`_prepare_soon`
      and :meth:`_donate_soon`. :meth:`_prepare` writes ``group``'s epoch, ``_prepared_for``,
      ``_fetch``, ``_early`` and ``_own_state`` under ``_prepare_lock``, on whichever thread
      acts on a quorum answer first; the training thread reads them only after its own
      :meth:`_prepare` of the same decision, which the lock orders after the other one.
      ``_donate_next`` is a plain flag: a late hint is acted on a step later.
    - ``unbroken-fetch`` and ``unbroken-catch-up-exchange`` (:func:`in_background`) read
      ``secret``, ``deadline``, ``device`` and the group; their results come back in the
      Futures held by ``_fetch`` and ``_early``, waited on by the training thread.
    - the recorder is appended to by the training thread and drained by the connection
      thread (bounded deques); ``client`` and ``catchup`` guard their own state.
    """

    def __init__(
        self,
        state_dict: StateDictFn | None = None,
        load_state_dict: LoadStateDictFn | None = None,
        config: ReplicaConfig | None = None,
        device: torch.device | None = None,
        deadline: LearnedDeadline | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        quorum_timeout_s: float = DEFAULT_QUORUM_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        fault_hook: FaultHook | None = None,
        link_fault: LinkDelay | None = None,
        cross_replica_backend: str | None = None,
    ) -> None:
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError(
                "pass both state_dict and load_state_dict, or neither (and register states "
                "with manager.register_state_dict_fn)"
            )
        self.config = config or ReplicaConfig.from_env()
        self.device = device or torch.device("cpu")
        self._state_fns: dict[str, tuple[LoadStateDictFn, StateDictFn]] = {}
        if state_dict is not None and load_state_dict is not None:
            self.register_state_dict_fn(LEGACY_STATE_KEY, load_state_dict, state_dict)
        self.last_step_committed = False
        self._closed = False
        self._warned_stateless = False
        self.deadline = deadline or LearnedDeadline()
        self.max_attempts = max_attempts
        self.quorum_timeout_s = quorum_timeout_s
        self.step = 0
        self.decision: QuorumDecision | None = None
        self.secret = JobSecret.required()  # the job's key: the store, the donors and peers demand it
        backend = cross_replica_backend or env_cross_replica_backend()
        check_backend(backend, self.device)
        self.group = CrossReplicaGroup(self.secret, backend=backend)
        # Peers on other nodes fetch from here: listen on the address that reaches the coordinator.
        self.catchup = CatchupServer(
            self.secret, host=local_address_towards(self.config.coordinator.rpartition(":")[0])
        )
        self.stats: dict[str, float] = {
            "exchange_failures": 0,
            "recoveries": 0,
            "donations": 0,
            "last_exchange_s": 0.0,
            "last_recovery_s": 0.0,
            "last_join_wait_s": 0.0,
        }
        self._quorum: Future[dict[str, Any]] | None = None
        # The next step's request, sent before this one's commit (request_next_quorum): (step, answer).
        self._next_quorum: tuple[int, Future[dict[str, Any]]] | None = None
        self._may_commit = False  # this step's sync_gradients() returned True and it is not committed yet
        self._buffer: torch.Tensor | None = None
        self._snapshot: SnapshotCopy | None = None  # a donation still being copied
        self._grad_numel: int | None = None  # see expect_gradients
        self._early: tuple[int, Future[tuple[float, torch.Tensor]]] | None = None  # epoch, (seconds, sum)
        self._overlap: OverlappedExchange | None = None  # this step's exchange during backward
        # Whether a failed exchange goes back to the loop instead of being redone in place with
        # the same gradients (see wait_quorum): set when the batches depend on the quorum.
        self.redo_failed_steps = False
        self._prepared_for: tuple[int, int] | None = None  # the (epoch, step) a catch-up started for
        self._donate_next = False  # the coordinator forecast that this replica serves a newcomer next
        self._last_commit: float | None = None
        self._step_time: float | None = None
        self._fetch: tuple[float, Future[_Fetched]] | None = None  # started at, the download
        # The donor and step of the newest catch-up decision, when a fetch for an older step was
        # already running: that fetch is finished first, then this one is made (see _finish_recovery).
        self._refetch: tuple[str, int] | None = None
        self._prewarmed = False
        self._prepare_lock = threading.Lock()
        self._own_state: dict[str, Any] | None = None  # a fresh process's tensors, see start_step
        self.prepare_early = prepare_early()
        self.fault_hook = fault_hook  # injected faults (unbroken.init() installs them), usually None
        self._compute_t0 = time.perf_counter()
        self._step_began = time.monotonic()  # when this step asked for its quorum
        record = recorder_enabled()
        self.recorder = FlightRecorder(self.config.replica_id, link_fault=link_fault) if record else None
        self.group.recorder = self.recorder
        self.anomaly_policy = parse_policy(anomaly_policy())
        self._metrics: tuple[float | None, float | None] = (None, None)
        signum = stack_signal()
        stack_file, self._stack_tmp = self._stack_dump_path()
        self._stack_dump = install_stack_dump(stack_file, signum) if signum is not None else None
        self._replica_store: tuple[AuthenticatedStore, StoreServer | None] | None = None
        if self.config.world_size > 1 and not dist.is_initialized():  # the script's own group wins
            backend = "gloo" if self.device.type == "cpu" else "nccl"
            self._replica_store = init_replica_group(self.config, self.secret, backend)
        self._vote_device = vote_device(dist.get_backend()) if self.config.world_size > 1 else torch.device("cpu")
        # No PID, stack file or signal in the hello: the process that started this rank
        # signals it and reads the stack file at the same path (unbroken.diagnosis.stacks).
        self.client = CoordinatorClient(
            self.config.coordinator,
            self.secret,
            hello={
                "replica": self.config.replica_id,
                "rank": self.config.rank,
                "world_size": self.config.world_size,
                "transfer_addr": self.catchup.address,
                "node": self.config.node,
            },
            on_abort=self.group.abort,
            on_donate=self._donate_soon,
            telemetry=self.recorder.batch if self.recorder is not None else None,
        )
        self.client.wait_connected(connect_timeout_from_env(connect_timeout_s))

    # -- the step ------------------------------------------------------------------------

    def start_step(self) -> None:
        """Asks for this step's quorum; the answer travels while the forward pass runs."""
        if self._quorum is None:
            self.last_step_committed = False
            if self._last_commit is None and self._own_state is None:
                # A process that has not trained yet is most likely a restarted one about to
                # catch up: note where its tensors live, here on the training thread, so the
                # fetch can write the donor's bytes straight into them.
                with contextlib.suppress(Exception):
                    self._own_state = self._local_state()
            asked, self._next_quorum = self._next_quorum, None
            if asked is not None and asked[0] == self.step:
                self._quorum = asked[1]  # asked when the last step's exchange ended
            else:
                self._quorum = self._request_quorum(None)
                if self.prepare_early:
                    self._quorum.add_done_callback(self._prepare_soon)
            if self._donate_next and self._snapshot is None and self._last_commit is not None:
                # Told that a newcomer will be admitted at this step with this replica as its
                # donor: snapshot now, so the peer's fetch overlaps this step's compute.
                self._donate_next = False
                self._take_snapshot(early=True)
            self._compute_t0 = time.perf_counter()
            if self.fault_hook is not None:
                self.fault_hook.start_step(self.step)

    def wait_quorum(self) -> QuorumDecision:
        """This step's quorum decision: who trains it and who catches up; waits for it.

        For a loop whose batches depend on who contributes (:mod:`unbroken.train.data`): call
        it after :meth:`start_step`, before the forward pass. The exchange of the step then
        runs under this decision. With :attr:`redo_failed_steps` set, an exchange that fails
        is not redone in place with the same gradients: the step is reported as not committed
        (:meth:`sync_gradients` returns False) and the loop's next attempt gets the new
        decision here, and batches planned for it.
        """
        o = self._overlap
        if o is not None and o.step == self.step and o.decision is not None:
            return o.decision
        self.start_step()
        if self._quorum is None:  # already taken by this step's exchange
            assert self.decision is not None
            return self.decision
        return self._prepare(self._quorum.result(timeout=self.quorum_timeout_s))

    def expect_gradients(self, numel: int) -> None:
        """Announces how many gradient elements (this rank's shards) :meth:`allreduce` averages.

        With it, a replica that is catching up enters its zero-gradient exchange as soon as the
        quorum answer arrives, not after the forward and backward pass whose gradient it
        discards, so its peers do not wait for that pass. The unbroken wrappers announce it.
        """
        if numel <= 0:
            raise ValueError(f"expect_gradients() needs a positive element count, got {numel}")
        self._grad_numel = numel

    @property
    def lr_scale(self) -> float:
        """sqrt(contributing / configured replicas) while replicas are missing, else 1."""
        if not self.config.lr_scaling or self.decision is None:
            return 1.0
        return min(1.0, math.sqrt(self.decision.contributing / self.config.num_replicas))

    @property
    def contributing(self) -> int:
        return self.decision.contributing if self.decision else 1

    def allreduce(self, grads: list[torch.Tensor]) -> bool:
        """Averages ``grads`` in place over the contributing replicas.

        Retries in a new epoch when a peer fails; a replica that is behind sends zeros and
        loads the donor's state before returning. Returns whether the caller may apply the
        optimizer step (every rank of this replica group succeeded).
        """
        self.start_step()
        try:
            return self._allreduce(grads)
        finally:
            self._settle_snapshot()

    def sync_gradients(self, grads: list[torch.Tensor]) -> bool:
        """Ends this step's gradient exchange; True when the optimizer may step.

        When the gradients were already averaged during the backward pass (by
        :class:`~unbroken.train.ddp.DistributedDataParallel` or :meth:`process_group`), returns
        that outcome, after this replica's ranks agreed on it, without exchanging again;
        otherwise averages ``grads`` now, as :meth:`allreduce`. On True, a loop that is sure to
        commit can send the next step's quorum request first (:meth:`request_next_quorum`).
        """
        ok = self._sync_gradients(grads)
        self._may_commit = ok
        return ok

    def request_next_quorum(self) -> None:
        """Asks for the next step's quorum now, between a True :meth:`sync_gradients` and :meth:`commit`.

        The answer then travels while the optimizer steps instead of holding up the next
        forward pass (on a busy 2-core host the round trip took 10-20 ms, 2-4% of the example
        Llama's step). Call it only when the step will be committed: a replica that asks for
        the next step and then does not commit asks again for the step it did not apply, and
        the coordinator evicts it as a replica whose state went back (it rejoins and catches up).
        :class:`unbroken.Optimizer` calls it before stepping the wrapped optimizer.

        Raises:
            RuntimeError: this step's exchange has not succeeded (or the step is committed).
        """
        if not self._may_commit:
            raise RuntimeError(
                "request_next_quorum() is for a step whose sync_gradients() returned True, before commit()"
            )
        self._may_commit = False
        if self._quorum is not None or self._own_state is not None or self._fetch is not None:
            return  # a request of this step is outstanding, or a fetch may still write into our tensors
        fut = self._request_quorum(None, step=self.step + 1)
        if self.prepare_early:
            fut.add_done_callback(self._prepare_soon)
        self._next_quorum = (self.step + 1, fut)

    def _sync_gradients(self, grads: list[torch.Tensor]) -> bool:
        overlap = self._overlap
        if overlap is not None and overlap.outcome is None and overlap.step != self.step:
            overlap = None  # begun in an earlier step that never asked for its outcome
        if overlap is None or (overlap.decision is None and overlap.outcome is None):
            self._overlap = None
            return self.allreduce(grads)
        try:
            if overlap.outcome is None:  # process_group(): each sum was waited for in its own call
                ok = self._overlap_agreed(overlap)  # any left in flight (async_op) are waited for here
                if not ok:
                    self._overlap_failed(overlap)
                overlap.outcome = ok
            return overlap.outcome
        finally:
            self._overlap = None
            self._settle_snapshot()

    def process_group(self) -> Any:
        """A ``torch.distributed`` process group over the replicas, for gradients only.

        ``dist.all_reduce(t, group=pg)`` (``SUM`` or ``AVG`` over the contributing replicas)
        and FSDP2's ``set_all_reduce_hook`` exchange through this step's fault-tolerant
        group; :meth:`sync_gradients` then says whether the step may commit. See
        :mod:`unbroken.train.process_group`.
        """
        from unbroken.train.process_group import ManagedProcessGroup

        return ManagedProcessGroup(self)

    def begin_overlap(self) -> OverlappedExchange:
        """Starts this step's exchange during backward, at its first bucket (idempotent).

        Waits for the quorum (asked for when the step started). When a replica catches up this
        step, every member exchanges after the backward pass instead (``decision`` None), in
        the single buffer the catching-up replica sends early; its donor's snapshot is then
        taken there, not in the middle of a backward pass.
        """
        if self._overlap is not None and self._overlap.step == self.step:
            return self._overlap  # the step's later buckets, or its next backward pass
        self.start_step()
        assert self._quorum is not None
        d = self._prepare(self._quorum.result(timeout=self.quorum_timeout_s))
        if d.behind or not self.group.overlaps:
            self._overlap = OverlappedExchange(None, step=self.step)
            return self._overlap
        d = self._await_quorum(None)
        skip = wants_skip(*self._metrics, self.anomaly_policy)
        if skip:
            if self.recorder is not None:
                self.recorder.record_step(self.step, *self._metrics, None)
            log.warning("replica %d step %d: %s, sitting this step out", self.config.replica_id, self.step, skip)
        self._overlap = OverlappedExchange(d, step=self.step, skip=bool(skip))
        return self._overlap

    def start_bucket(self, buf: torch.Tensor) -> None:
        """Starts summing one bucket: ``buf`` holds its gradients and :data:`METADATA` free slots.

        Every member starts the same buckets in the same order. After a failure nothing more is
        started; the buffers of the step are then never used again.
        """
        o = self.begin_overlap()
        if o.decision is None or o.failed:
            return
        n = buf.numel() - METADATA
        if o.skip:
            buf.zero_()
        buf[n] = 0.0 if o.skip else 1.0
        buf[n + 1] = float(o.decision.step)
        buf[n + 2] = 1.0 if o.skip else 0.0
        total = 4 * (self._grad_numel or 0)
        try:
            o.pending.append(self.group.start_allreduce_sum(buf, self.deadline.seconds, total))
            o.buffers.append(buf)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.config.replica_id, self.step, e)
            o.failed = True

    def wait_buckets(self, last: bool = True) -> bool:
        """Waits for the buckets started so far and checks every member's step and contribution.

        ``last``: the end of the backward pass, the step's exchange is complete. The wait is
        the part of the exchange that compute did not hide, which the deadline learns from.
        Returns False after any failure; the sums are then not to be used.
        """
        o = self._overlap
        assert o is not None and o.decision is not None
        if last:  # this rank's own time for the step, without waiting for peers
            self.client.compute_s = time.perf_counter() - self._compute_t0 - o.waited_s
            if self.fault_hook is not None:
                self.fault_hook.before_exchange(self.step, o.decision.members, 4 * (self._grad_numel or 0))
        if o.failed:
            return False
        pending, o.pending = o.pending, []
        if not pending:  # all waited for already (process_group()): this only closes the record
            self.group.finish_allreduce_sums([], self.deadline.seconds, last=last)
            return True
        waiting = time.perf_counter()
        try:
            seconds = self.group.finish_allreduce_sums(pending, self.deadline.seconds, last=last)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.config.replica_id, self.step, e)
            o.failed = True
            return False
        finally:
            o.waited_s += time.perf_counter() - waiting
        for buf in o.buffers[len(o.buffers) - len(pending) :]:
            contributing = self._check_exchanged(buf, o.decision)
            if contributing is None:
                o.failed = True
                return False
            o.contributing = contributing
        self.deadline.observe(seconds)
        self.stats["last_exchange_s"] = seconds
        self.stats["last_join_wait_s"] = self.group.last_join_wait_s
        self.stats["last_exchange_busy_s"] = busy_seconds(pending)
        return True

    def end_overlap(self, grads: list[torch.Tensor], write_back: Callable[[float], None]) -> bool:
        """Ends a step whose buckets were all started: waits, agrees, then writes or redoes.

        ``write_back(scale)`` writes each bucket's sum times ``scale`` into the gradients; it
        runs only once every bucket succeeded and every rank of this replica agreed, so that a
        failed step still holds this replica's own ``grads``, which are then averaged in a new
        epoch (the synchronous path of :meth:`allreduce`). A deferred step (someone catches
        up) takes that path directly.
        """
        o = self.begin_overlap()
        try:
            if o.decision is None:
                o.outcome = self._allreduce(grads)
                return o.outcome
            if self._overlap_agreed(o):
                write_back(1.0 / o.contributing)
                o.outcome = True
                return True
            if o.contributing == 0 and not o.failed:  # every replica sat this step out: nothing to apply
                o.outcome = False
                return False
            if self.redo_failed_steps:
                self._overlap_failed(o)
                o.outcome = False
                return False
            self.stats["exchange_failures"] += 1
            o.outcome = self._allreduce(grads, failed=o.decision.epoch)
            return o.outcome
        finally:
            self._settle_snapshot()  # a donor's copy is complete before any optimizer steps

    def _overlap_agreed(self, o: OverlappedExchange) -> bool:
        """Whether the step exchanged during backward may be applied: every bucket summed and
        checked, some replica contributed, and every rank of this replica agrees."""
        return self._vote(self.wait_buckets() and o.contributing > 0)

    def _overlap_failed(self, o: OverlappedExchange) -> None:
        """A step exchanged during backward failed: its redo asks for a quorum without that epoch."""
        if o.decision is None or (o.contributing == 0 and not o.failed):
            return
        self.stats["exchange_failures"] += 1
        self._quorum = self._request_quorum(o.decision.epoch)
        if self.prepare_early:
            self._quorum.add_done_callback(self._prepare_soon)

    def _allreduce(self, grads: list[torch.Tensor], failed: int | None = None) -> bool:
        for _ in range(self.max_attempts):
            decision = self._await_quorum(failed)
            behind = self.config.replica_id in decision.behind
            if self.fault_hook is not None:
                self.fault_hook.before_exchange(self.step, decision.members, 4 * sum(g.numel() for g in grads), grads)
            if failed is None:  # this rank's own time for the step, without waiting for peers
                self.client.compute_s = time.perf_counter() - self._compute_t0
            exchanged = self._exchange(grads, decision, zero=behind)
            ok = self._vote(exchanged and (not behind or self._fetched()))
            if ok:
                if behind:
                    self._finish_recovery(decision)
                return True
            failed = decision.epoch
            self.stats["exchange_failures"] += 1
            if self.redo_failed_steps:  # the loop redoes the step with batches for the next quorum
                self._quorum = self._request_quorum(failed)
                if self.prepare_early:
                    self._quorum.add_done_callback(self._prepare_soon)
                return False
        log.error("step %d: no exchange succeeded in %d attempts; skipping it", self.step, self.max_attempts)
        return False

    def report(self, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Hands this step's loss and gradient norm to the diagnosis (call before the exchange).

        A non-finite value makes this replica sit the step out (it contributes no gradient) when
        the anomaly policy says ``skip_step``; the value also reaches the coordinator's detectors.
        """
        self._metrics = (loss, grad_norm)

    def commit(self) -> None:
        """Marks the step applied; the next :meth:`start_step` asks for the next one."""
        self.last_step_committed = True
        self._may_commit = False
        if self.recorder is not None:
            self.recorder.record_step(self.step, *self._metrics, None)
        self._metrics = (None, None)
        now = time.perf_counter()
        if self._last_commit is not None:
            self._step_time = now - self._last_commit
        self._last_commit = now
        self._own_state = None  # trained without catching up: nothing to receive into
        self.step += 1
        if not self._prewarmed:
            # The state is complete (optimizer state exists) only after the first commit.
            self._prewarmed = True
            self.catchup.pool.prewarm(snapshot_layout(self._local_state())[3])

    def report_loss(self, loss: float, step: int | None = None) -> float:
        """The loss to report for ``step``; passes through injected faults (a NaN on purpose)."""
        value = loss if self.fault_hook is None else self.fault_hook.loss(loss, self.step if step is None else step)
        self._metrics = (value, self._metrics[1])
        return value

    def shutdown(self, finished: bool = True) -> None:
        """Leaves the job: as a finished replica (the default), or as a failed one when
        ``finished`` is False. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.client.close(finished=finished)
        self.group.close(timeout_s=SHUTDOWN_RELEASE_S)
        self.catchup.close()
        if self._replica_store is not None and self._replica_store[1] is not None:
            self._replica_store[1].close()
        if self._stack_tmp is not None:
            shutil.rmtree(self._stack_tmp, ignore_errors=True)

    def __enter__(self) -> Manager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown(finished=exc_type is None)

    # -- state -----------------------------------------------------------------------------

    def register_state_dict_fn(self, key: str, load_state_dict: LoadStateDictFn, state_dict: StateDictFn) -> None:
        """Adds ``key`` to the state a recovering peer fetches and a checkpoint holds.

        ``state_dict`` returns the state (nested dicts, lists and tensors; DTensors are sent as
        local shards), ``load_state_dict`` applies it. Both run on the training thread between
        steps; tensors of 1 MB or more are copied while a step runs, so they must change only in
        the optimizer step (parameters and optimizer state do). Register the same keys on every
        replica, before its first step; :func:`unbroken.model_state` covers a model and its
        optimizer.

        Raises:
            ValueError: ``key`` is empty or already registered.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"a state key must be a non-empty string, got {key!r}")
        if key in self._state_fns:
            raise ValueError(f"a state is already registered under {key!r}: pick another key")
        if not callable(load_state_dict) or not callable(state_dict):
            raise TypeError(f"register_state_dict_fn({key!r}, load_state_dict, state_dict) takes two callables")
        self._state_fns[key] = (load_state_dict, state_dict)

    def _stack_dump_path(self) -> tuple[str, str | None]:
        """Where this rank's stack dump goes: the run directory, or a private temporary one
        (removed at shutdown) for a process launched without one, never the working directory."""
        if run_dir_given() or self.config.run_dir not in (".", ""):
            return stack_path(self.config.run_dir, self.config.replica_id, self.config.rank), None
        tmp = tempfile.mkdtemp(prefix="unbroken-stacks-")
        return os.path.join(tmp, os.path.basename(stack_path(tmp, self.config.replica_id, self.config.rank))), tmp

    # -- internals -----------------------------------------------------------------------

    def _request_quorum(self, failed_epoch: int | None, step: int | None = None) -> Future[dict[str, Any]]:
        """Asks for this step's quorum (again, after ``failed_epoch``); the attempt begins now.

        ``step``: the next step's, asked for before this one is committed (request_next_quorum);
        that step's attempt begins then (this step's vote, the last use of the old time, is over)."""
        self._step_began = time.monotonic()
        failure = self.group.last_failure
        error = failure[1] if failure is not None and failed_epoch is not None and failure[0] == failed_epoch else None
        return self.client.request_quorum(self.step if step is None else step, failed_epoch, self._step_time, error)

    def _await_quorum(self, failed_epoch: int | None) -> QuorumDecision:
        if failed_epoch is not None or self._quorum is None:
            self._quorum = self._request_quorum(failed_epoch)
        fut, self._quorum = self._quorum, None
        msg = fut.result(timeout=self.quorum_timeout_s)
        d = self._prepare(msg)
        donating = any(donor == self.config.replica_id for (_, donor) in d.donors)
        if donating:
            self._donate_next = False  # a hint that came too late for this step is spent on it
            if self._snapshot is None or self._snapshot.snapshot.step != d.step:
                self._take_snapshot(early=False)  # the coordinator's hint did not come in time
            self.stats["donations"] += 1
        self.decision = d
        return d

    def _take_snapshot(self, early: bool) -> None:
        """Snapshots the state of this step for a peer, before the optimizer moves it.

        Taken on the training thread; the bulk (large host tensors) is copied on a background
        thread beside the step's compute and exchange, which read those tensors but do not
        change them, and the snapshot is served once complete. ``allreduce`` waits for the copy
        before it returns, that is, before the optimizer steps.
        """
        taken = time.perf_counter()
        self._snapshot = SnapshotCopy(self.step, self._local_state(), self.catchup.pool, self.catchup.publish)
        self.stats["last_snapshot_s"] = time.perf_counter() - taken
        self.stats["last_snapshot_early"] = float(early)

    def _donate_soon(self, newcomer: int) -> None:
        """The coordinator's hint (connection thread): snapshot at the next step start."""
        log.info("replica %d will likely serve replica %d at its next step", self.config.replica_id, newcomer)
        self._donate_next = True

    def _settle_snapshot(self) -> None:
        """Waits until a donated snapshot is fully copied: the caller's optimizer steps next."""
        if self._snapshot is not None:
            waited = time.perf_counter()
            self._snapshot.wait()
            self._snapshot = None
            self.stats["last_snapshot_wait_s"] = time.perf_counter() - waited

    def _prepare_soon(self, fut: Future[dict[str, Any]]) -> None:
        """Acts on a quorum answer the moment it arrives, while the forward pass still runs.

        A new epoch's rendezvous and a behind replica's fetch then overlap the compute of
        the step instead of starting after it, which every member would otherwise wait for.
        Runs on the coordinator connection's thread; anything that fails here is done again,
        and raised, on the training thread in :meth:`_await_quorum`.
        """
        try:
            self._prepare(fut.result())
        except Exception as e:  # noqa: BLE001 - retried where it can be raised
            log.debug("early preparation of a quorum failed: %s", e)

    def _prepare(self, msg: dict[str, Any]) -> QuorumDecision:
        """Joins the decision's epoch and starts this replica's fetch if it is behind (idempotent)."""
        d = QuorumDecision.from_json(msg["decision"])
        me = self.config.replica_id
        with self._prepare_lock:
            if self.group.epoch != d.epoch:
                self.group.configure(
                    msg.get("store") or self.client.store_address or "",
                    d.epoch,
                    d.members.index(me),
                    len(d.members),
                    tag=f"rank{self.config.rank}",
                    device=self.device,
                    members=list(d.members),
                )
            # Once per decision: the training thread may have finished with them already when the
            # connection thread's callback gets here, and a second exchange would pair with the
            # peers' next collective.
            if me in d.behind and self._prepared_for != (d.epoch, d.step):
                self._prepared_for = (d.epoch, d.step)
                addrs: dict[str, str] = msg.get("transfer_addrs", {})
                if self._fetch is None:
                    self._start_fetch(addrs[str(d.donor_of(me))], d.step)
                    self._refetch = None
                else:  # a fetch of an earlier decision runs on (it may be for this very step)
                    self._refetch = (addrs[str(d.donor_of(me))], d.step)
                if self._grad_numel is not None:
                    self._start_early_exchange(d, self._grad_numel)
        return d

    def _full_state(self) -> dict[str, Any]:
        """Every registered state and the step, tensors as the state functions return them."""
        if not self._state_fns and not self._warned_stateless:
            self._warned_stateless = True
            log.warning(
                "no state is registered (manager.register_state_dict_fn): a replica that catches "
                "up or resumes gets only the step number, not the model"
            )
        user = {key: save() for key, (_, save) in self._state_fns.items()}
        return {"user": user, "unbroken": {"step": self.step}}

    def _local_state(self) -> dict[str, Any]:
        """What a peer is sent: :meth:`_full_state` with DTensors as this rank's local shards."""
        return as_local(self._full_state())

    def state_dict(self) -> dict[str, Any]:
        """This replica's whole state: every registered state and its step.

        What a checkpoint must hold for a resumed or rolled-back replica to rejoin at the
        right step; the same thing a donor sends a recovering peer. DTensors come as
        :class:`~unbroken.checkpoint.Shard` markers of this rank's local piece, which the
        Checkpointer stores with their place in the global tensor. Call between steps.
        """
        return as_shards(self._full_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned (say, from a checkpoint); call between steps."""
        self._load_user(state["user"])
        self.step = int(state["unbroken"]["step"])

    def _load_user(self, user: dict[str, Any]) -> None:
        missing = [k for k in self._state_fns if k not in user]
        unknown = [k for k in user if k not in self._state_fns]
        if missing or unknown:
            raise ValueError(
                f"the loaded state holds {sorted(user)} but this replica registered "
                f"{sorted(self._state_fns)}: register the same keys as the replica that saved it"
                + (f" (missing: {missing})" if missing else "")
                + (f" (unknown: {unknown})" if unknown else "")
            )
        for key, (load, _) in self._state_fns.items():
            load(user[key])

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this replica saves the job's checkpoint after this step.

        The lowest-numbered member that is not catching up: replicas hold the same state, so
        one copy per step is enough, and when that replica is gone the next one takes over.
        """
        d = self.decision
        if d is None:
            return False
        up = [m for m in d.members if m not in d.behind_set]
        return bool(up) and self.config.replica_id == min(up)

    def _start_fetch(self, address: str, step: int) -> None:
        """Starts downloading the donor's state of ``step`` (runs on the connection thread
        when prepared early); the training thread waits for it in :meth:`_finish_recovery`."""
        into, self._own_state = self._own_state, None

        def run() -> _Fetched:
            cpu = time.thread_time()
            state = fetch_state(address, step, self.secret, into=into)
            return _Fetched(state, time.perf_counter(), time.thread_time() - cpu)

        self._fetch = (time.perf_counter(), in_background("unbroken-fetch", run))

    def _fetched(self) -> bool:
        """Waits for this behind replica's download (bounded by its own timeout); False when it
        failed (a donor that died mid-transfer, a refusal past the retries).

        A failed catch-up is then a failed step at this rank, voted down like a failed exchange:
        the epoch is reported failed, the replica is still behind in the next one and fetches
        again, from whichever donor that epoch names. Before, it raised, and the process crashed
        into the supervisor's restart loop (10 restarts, then the replica was gone for good).
        """
        if self._fetch is None:
            return False
        try:
            self._fetch[1].result()
        except Exception as e:  # noqa: BLE001 - any failed download is retried in the next epoch
            log.warning("replica %d: catch-up from a donor failed (%s); fetching again", self.config.replica_id, e)
            self.stats["catch_up_failures"] = self.stats.get("catch_up_failures", 0) + 1
            self._fetch = self._refetch = None
            self._prepared_for = None
            return False
        return True

    def _finish_recovery(self, decision: QuorumDecision) -> None:
        assert self._fetch is not None
        started, download = self._fetch
        self._fetch = None
        try:
            fetched = download.result()
        except Exception as e:
            raise RuntimeError(f"catch-up from a donor failed: {e}") from e
        refetch, self._refetch = self._refetch, None
        if int(fetched.state["unbroken"]["step"]) != decision.step:
            # The fetch began for an earlier decision whose catch-up never completed (its epoch
            # failed) and the job has moved on since: that state is stale. The stale download
            # has ended (it wrote into this process's own tensors), so fetch the decision's step
            # now, into fresh memory. Seen in the peer-partition scenario of bench cluster.
            if refetch is None or refetch[1] != decision.step:
                raise RuntimeError(
                    f"catch-up fetched step {fetched.state['unbroken']['step']}, but the quorum trains "
                    f"step {decision.step} and names no donor for it"
                )
            try:
                state = fetch_state(refetch[0], decision.step, self.secret)
            except Exception as e:
                raise RuntimeError(f"catch-up from a donor failed: {e}") from e
            fetched = _Fetched(state, time.perf_counter(), fetched.cpu_s)
        state = fetched.state
        loading = time.perf_counter()
        self._load_user(state["user"])
        self.step = int(state["unbroken"]["step"])
        self.stats["recoveries"] += 1
        now = time.perf_counter()
        self.stats["last_recovery_s"] = now - started
        self.stats["last_fetch_s"] = fetched.done_at - started
        self.stats["last_load_s"] = now - loading
        self.stats["last_fetch_cpu_s"] = fetched.cpu_s
        if self.recorder is not None:
            self.recorder.note(CaughtUp(self.step, now - started, snapshot_layout(state)[3]))
        log.info(
            "replica %d caught up to step %d: fetch %.3fs, load %.3fs",
            self.config.replica_id,
            self.step,
            self.stats["last_fetch_s"],
            self.stats["last_load_s"],
        )

    def _exchange(self, grads: list[torch.Tensor], d: QuorumDecision, zero: bool) -> bool:
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        n = sum(g.numel() for g in locals_)
        early, self._early = self._early, None
        if zero and early is not None and early[0] == d.epoch:
            return self._finish_early_exchange(locals_, n, early[1], d)
        buf = self._buffer
        if buf is None or buf.numel() != n + 3:
            buf = self._buffer = torch.empty(n + 3, dtype=torch.float32, device=self.device)
        skip = None if zero else wants_skip(*self._metrics, self.anomaly_policy)
        if zero or skip:
            buf.zero_()
            if skip:  # sit this step out: no gradient, counted apart from the contributors
                buf[n + 2] = 1.0
                if self.recorder is not None:
                    self.recorder.record_step(self.step, *self._metrics, None)
                log.warning("replica %d step %d: %s, sitting this step out", self.config.replica_id, self.step, skip)
        else:
            offset = 0
            for g in locals_:
                buf[offset : offset + g.numel()].copy_(g.reshape(-1))
                offset += g.numel()
            buf[n] = 1.0
            buf[n + 2] = 0.0
        # Every member adds its step and whether it contributes, so a member that silently
        # trains a different step is caught instead of averaged in.
        buf[n + 1] = float(d.step)
        try:
            seconds = self.group.allreduce_sum(buf, self.deadline.seconds)
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.config.replica_id, self.step, e)
            self._buffer = None  # the backend may still write into it
            return False
        return self._apply_exchanged(locals_, buf, seconds, d)

    def _check_exchanged(self, buf: torch.Tensor, d: QuorumDecision) -> int | None:
        """The replicas whose gradients the summed ``buf`` holds; None when members disagree."""
        n = buf.numel() - METADATA
        contributing, step_sum, skipped = buf[n].item(), buf[n + 1].item(), round(buf[n + 2].item())
        if round(contributing) + skipped != d.contributing or step_sum != float(d.step) * len(d.members):
            log.warning("replica %d: members disagree on the step (%s); redoing it", self.config.replica_id, step_sum)
            return None
        return round(contributing)

    def _apply_exchanged(
        self, locals_: list[torch.Tensor], buf: torch.Tensor, seconds: float, d: QuorumDecision, observe: bool = True
    ) -> bool:
        """Checks the exchanged totals and writes the average into the gradients."""
        contributing = self._check_exchanged(buf, d)
        if contributing is None:
            return False
        if observe:
            self.deadline.observe(seconds)
        self.stats["last_exchange_s"] = seconds
        self.stats["last_join_wait_s"] = self.group.last_join_wait_s
        if contributing == 0:
            return False  # every replica sat this step out: nothing to apply
        scale = 1.0 / contributing
        offset = 0
        for g in locals_:
            torch.mul(buf[offset : offset + g.numel()].view_as(g), scale, out=g)
            offset += g.numel()
        return True

    def _start_early_exchange(self, d: QuorumDecision, numel: int) -> None:
        """Enters a catching-up replica's zero-gradient exchange now, on a background thread.

        Its gradient for this step is thrown away, so there is nothing to wait for: the
        survivors then find it already in the exchange instead of waiting for a forward and
        backward pass of a process that has just started (the slowest of the step).
        """

        def run() -> tuple[float, torch.Tensor]:
            buf = torch.zeros(numel + 3, dtype=torch.float32, device=self.device)
            buf[numel + 1] = float(d.step)
            return self.group.allreduce_sum(buf, self.deadline.seconds), buf

        self._early = (d.epoch, in_background("unbroken-catch-up-exchange", run))

    def _finish_early_exchange(
        self, locals_: list[torch.Tensor], n: int, exchange: Future[tuple[float, torch.Tensor]], d: QuorumDecision
    ) -> bool:
        try:
            seconds, buf = exchange.result()
        except ExchangeFailed as e:
            log.warning("replica %d step %d: %s", self.config.replica_id, self.step, e)
            return False
        if buf.numel() != n + 3:
            raise RuntimeError(
                f"expect_gradients() announced {buf.numel() - 3} gradient elements but allreduce() "
                f"got {n}: announce the same parameters the exchange averages (the unbroken wrappers do)"
            )
        self._buffer = buf
        # Not observed by the deadline: it includes the wait for the peers' forward and backward.
        return self._apply_exchanged(locals_, buf, seconds, d, observe=False)

    def _vote(self, ok: bool) -> bool:
        """Whether every rank of this replica group exchanged successfully (a MIN all-reduce on
        the replica's own group, with a tensor on the device its backend carries).

        A rank that went silent during the step long enough to have been evicted votes no,
        whatever its sum says (:mod:`unbroken.control.silence`)."""
        if ok and self.client.silence.silent_since(self._step_began, time.monotonic()):
            log.warning(
                "replica %d step %d: this process was silent past half the coordinator's eviction "
                "timeout during the step (stopped?): not committing it",
                self.config.replica_id,
                self.step,
            )
            ok = False
        if self.config.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self._vote_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


@dataclasses.dataclass(frozen=True)
class _Fetched:
    """A donor's state as downloaded, with when the download ended and the CPU it took."""

    state: Any
    done_at: float
    cpu_s: float


def in_background(name: str, fn: Callable[[], T]) -> Future[T]:
    """Runs ``fn`` on a new daemon thread called ``name``; its result or exception in a Future.

    Not a ``ThreadPoolExecutor``: its workers are joined when the interpreter exits, and a
    fetch from a dead donor or an exchange with a hung peer (each bounded, but by tens of
    seconds) must not hold up a replica that is failing or finishing.
    """
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def vote_device(backend: str) -> torch.device:
    """The device of a tensor that the default group's ``backend`` can all-reduce.

    NCCL takes only CUDA tensors; Gloo, and a group with a CPU backend beside NCCL
    (``"cpu:gloo,cuda:nccl"``), takes CPU ones, which saves a host-device copy.
    """
    entries = backend.lower().split(",")  # "nccl", or per device: "cpu:gloo,cuda:nccl"
    if any(e.startswith("cpu:") for e in entries) or all(e.rpartition(":")[2] != "nccl" for e in entries):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
