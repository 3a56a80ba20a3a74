"""The replica step protocol: quorum, reconfigure, catch up, exchange, vote, commit.

One :class:`Manager` per rank. A training loop calls :meth:`start_step` when a step begins
(the quorum request then travels while the forward pass runs) and :meth:`sync_gradients` after
the backward pass; it applies the optimizer step only if that returns True, then calls
:meth:`commit`. The optimizer wrapper in :mod:`unbroken.train.optimizer` does all three, and
:attr:`Manager.last_step_committed` tells the loop whether the step was applied.

What a recovering peer fetches and a checkpoint holds is the dict of every state registered
with :meth:`Manager.register_state_dict_fn` (see :mod:`unbroken.train.state`). The Manager is
given its built parts (the coordinator client, the cross-replica group, the catch-up server);
:func:`unbroken.train.factory.build_manager` builds them from the environment, as
``unbroken.init()`` does. The replica's side of live catch-up is in :mod:`unbroken.train.step.catch_up`,
the layout of an exchanged buffer in :mod:`unbroken.train.step.overlap`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import torch

from unbroken.comm.catchup import CatchupServer
from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.comm.deadline import LearnedDeadline
from unbroken.comm.fingerprint import fold, state_prints
from unbroken.comm.recorder import FlightRecorder
from unbroken.config import ReplicaConfig
from unbroken.control.client import CoordinatorClient
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.diagnosis.rules.metrics import parse_policy, wants_skip
from unbroken.train.hooks import FaultHook
from unbroken.train.managed_group import ManagedProcessGroup
from unbroken.train.state import LoadStateDictFn, StateDictFn, StateRegistry, as_local, as_shards, check_state_pair
from unbroken.train.step.catch_up import CatchUp, DonateHint
from unbroken.train.step.exchange import GradientExchange
from unbroken.train.step.overlap import OverlappedExchange
from unbroken.train.step.sdc_check import ExchangeCheck
from unbroken.train.step.vote import ReplicaVote
from unbroken.wire.auth import JobSecret

log = logging.getLogger(__name__)

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
    decides. ``unbroken.init()`` builds it (:func:`~unbroken.train.factory.build_manager`); a
    test builds it with stand-ins for its parts.

    Args:
        state_dict, load_state_dict: a convenience for one state, registered under the key
            ``"state"``; :meth:`register_state_dict_fn` registers any number, at any time.
        config: where this rank sits.
        client: the connection to the coordinator (quorums, heartbeats, aborts, donate hints).
        group: the cross-replica group each epoch's exchange runs on.
        catchup: the server a recovering peer fetches this replica's state from.
        secret: the job's key, which donors and peers demand.
        device: where gradients live (CPU: the exchange runs on Gloo).
        recorder: the flight recorder (None when recording is off).
        donate_hint: set by the client when this replica will likely serve a newcomer next.
        vote_device: where the vote's tensor lives (the replica's own group's backend).
        deadline: how long an exchange may take before a peer is presumed hung.
        max_attempts: exchange attempts per step before the step is given up.
        quorum_timeout_s: how long to wait for a quorum (training waits while fewer than
            ``min_replicas`` are alive).
        prepare_early: act on a quorum answer on the connection thread as it arrives.
        anomaly_policy: what a non-finite loss or gradient norm does (``parse_policy``).
        fault_hook: injected faults (``unbroken.init()`` installs them), usually None.
        verify_exchange: compare every exchange's sums across the replicas before committing
            (:mod:`unbroken.train.step.sdc_check`).
        weights_every: also compare the replicas' parameters and optimizer state every this
            many steps (0: never).
        on_shutdown: releases what the factory set up beside the parts (run at shutdown).

    Attributes:
        step: the number of steps this replica has committed (the job's step).
        last_step_committed: whether the step begun by the last :meth:`start_step` was applied:
            False from :meth:`start_step` (``optimizer.zero_grad()``) until :meth:`commit`. After
            ``optimizer.step()`` it says whether the optimizer really stepped; a step that failed
            (a peer died mid-exchange, every replica sat it out) leaves ``step`` where it was.
        sdc: the check of every exchange's sums across replicas (:class:`~unbroken.train.step.sdc_check.ExchangeCheck`):
            its ``findings``, ``detected`` count and ``last_result`` (the committed sum's fingerprint).

    Thread model (docs/architecture.md, "Threads of a replica process"). Every public method
    runs on the training thread, which owns the step's state (``step``, ``decision``,
    ``stats``, ``_quorum``, ``_buffer``, ``_overlap``, the donor's snapshot, ``_metrics``, the
    state functions). Other threads touch only:

    - ``unbroken-coordinator`` (the client's connection thread) runs :meth:`_prepare_soon`
      and sets the donate hint. :meth:`_prepare` writes ``group``'s epoch and the catch-up's
      plan, download and early exchange under ``_prepare_lock``, on whichever thread acts on a
      quorum answer first; the training thread reads them only after its own :meth:`_prepare`
      of the same decision, which the lock orders after the other one. A late donate hint is
      acted on a step later.
    - ``unbroken-fetch`` and ``unbroken-catch-up-exchange``
      (:func:`~unbroken.train.step.catch_up.in_background`) read ``secret``, ``deadline``,
      ``device`` and the group; their results come back in Futures waited on by the training
      thread.
    - the recorder is appended to by the training thread and drained by the connection
      thread (bounded deques); ``client`` and ``catchup`` guard their own state.
    """

    def __init__(
        self,
        state_dict: StateDictFn | None = None,
        load_state_dict: LoadStateDictFn | None = None,
        *,
        config: ReplicaConfig,
        client: CoordinatorClient,
        group: CrossReplicaGroup,
        catchup: CatchupServer,
        secret: JobSecret,
        device: torch.device | None = None,
        recorder: FlightRecorder | None = None,
        donate_hint: DonateHint | None = None,
        vote_device: torch.device | None = None,
        deadline: LearnedDeadline | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        quorum_timeout_s: float = DEFAULT_QUORUM_TIMEOUT_S,
        prepare_early: bool = False,
        anomaly_policy: dict[str, str] | None = None,
        fault_hook: FaultHook | None = None,
        on_shutdown: Callable[[], None] | None = None,
        verify_exchange: bool = True,
        weights_every: int = 0,
    ) -> None:
        check_state_pair(state_dict, load_state_dict)
        self.config = config
        self.device = device or torch.device("cpu")
        self._states = StateRegistry()
        if state_dict is not None and load_state_dict is not None:
            self.register_state_dict_fn(LEGACY_STATE_KEY, load_state_dict, state_dict)
        self.last_step_committed = False
        self._closed = False
        self.deadline = deadline or LearnedDeadline()
        self.max_attempts = max_attempts
        self.quorum_timeout_s = quorum_timeout_s
        self.step = 0
        self.decision: QuorumDecision | None = None
        self.secret = secret
        self.group = group
        self.catchup = catchup
        self.client = client
        self.recorder = recorder
        self.stats: dict[str, float] = {
            "exchange_failures": 0,
            "recoveries": 0,
            "donations": 0,
            "last_exchange_s": 0.0,
            "last_recovery_s": 0.0,
            "last_join_wait_s": 0.0,
            "last_quorum_wait_s": 0.0,  # the step's wait for its quorum answer
        }
        self._catch_up = CatchUp(catchup, secret, config.replica_id, self.stats, recorder, donate_hint)
        self.sdc = ExchangeCheck(config.replica_id, weights_every, enabled=verify_exchange, recorder=recorder)
        self._exchanger = GradientExchange(
            group,
            self.deadline,
            self.stats,
            self.device,
            config.replica_id,
            check=self.sdc,
            weights=lambda: fold(state_prints(self._states.full(self.step))),
            on_result=getattr(fault_hook, "after_exchange", None),
        )
        self._quorum: Future[dict[str, Any]] | None = None
        # The next step's request, sent before this one's commit (request_next_quorum): (step, answer).
        self._next_quorum: tuple[int, Future[dict[str, Any]]] | None = None
        self._may_commit = False  # this step's sync_gradients() returned True and it is not committed yet
        self._grad_numel: int | None = None  # see expect_gradients
        self._overlap: OverlappedExchange | None = None  # this step's exchange during backward
        self._after_catch_up = False  # the last step began had a member catching up
        # Whether a failed exchange goes back to the loop instead of being redone in place with
        # the same gradients (see wait_quorum): set when the batches depend on the quorum.
        self.redo_failed_steps = False
        # Whether a step in which a replica catches up is exchanged bucket by bucket too (see
        # begin_overlap): set by a loop that reads each all-reduce's result when it is waited
        # for (torchft's API), instead of at the step's end.
        self.catch_up_in_buckets = False
        # Whether a catch-up may write the donor's bytes straight into the tensors this
        # process's state_dict() returned: not where state_dict() hands cached buffers that each
        # call rewrites (torchtitan's, under the torchft facade), which the load would undo.
        self.fetch_in_place = True
        self._last_commit: float | None = None
        self._step_time: float | None = None
        self._prepare_lock = threading.Lock()
        self.prepare_early = prepare_early
        self.fault_hook = fault_hook
        self._compute_t0 = time.perf_counter()
        self._step_began = time.monotonic()  # when this step asked for its quorum
        self.anomaly_policy = anomaly_policy if anomaly_policy is not None else parse_policy("")
        self._metrics: tuple[float | None, float | None] = (None, None)
        self._voter = ReplicaVote(
            config.world_size,
            client.silence,
            vote_device or torch.device("cpu"),
            config.replica_id,
            superseded=self._epoch_superseded,
        )
        self._on_shutdown = on_shutdown
        bind = getattr(fault_hook, "bind_state", None)
        if bind is not None:  # an injected bit flip in a weight or a moment reaches the state
            bind(lambda: self._states.full(self.step))
        self._error: BaseException | None = None  # see report_error
        self._vetoed = False  # the last vote was vetoed: the step goes back to the loop, not redone

    # -- the step ------------------------------------------------------------------------

    def start_step(self) -> None:
        """Asks for this step's quorum; the answer travels while the forward pass runs."""
        if self._quorum is None:
            self.last_step_committed = False
            if self._last_commit is None and self.fetch_in_place:  # not trained yet: most likely about to catch up
                self._catch_up.note_own_state(self._local_state)
            asked, self._next_quorum = self._next_quorum, None
            if asked is not None and asked[0] == self.step:
                self._quorum = asked[1]  # asked when the last step's exchange ended
            else:
                self._quorum = self._ask(None)
            if self._last_commit is not None:
                self._catch_up.donate_if_hinted(self.step, self._local_state)
            self._compute_t0 = time.perf_counter()
            if self.fault_hook is not None:
                self.fault_hook.start_step(self.step)
            if self._exchanger.weights is not None and self._last_commit is not None:
                # (A process that has not trained yet is most likely about to catch up.)
                self.sdc.note_weights(self.step, self._exchanger.weights)

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
        return self._prepare(self._answer(self._quorum))

    def _answer(self, fut: Future[dict[str, Any]]) -> dict[str, Any]:
        """A quorum answer. A replica of a job with hot spares waits without a bound: parked (a
        spare, or a member whose place a spare took while it hung) it may wait for a place until
        the job ends. The client fails the request once the coordinator is lost for its
        reconnect timeout, and the coordinator's no-progress rule ends a job that cannot train."""
        waited = time.perf_counter()
        answer = fut.result(timeout=None if self.config.wait_to_join else self.quorum_timeout_s)
        self.stats["last_quorum_wait_s"] = time.perf_counter() - waited
        return answer

    @property
    def quorum_pending(self) -> bool:
        """Whether this step's quorum answer is still to be taken by its exchange.

        While it is, :meth:`wait_quorum` returns it; once the exchange took it, ``decision`` is
        the step's, and :meth:`wait_quorum` would ask for the next step's quorum.
        """
        return self._quorum is not None

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
            self._catch_up.settle()

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
        if self._quorum is not None or self._catch_up.own_state is not None or self._catch_up.fetching:
            return  # a request of this step is outstanding, or a fetch may still write into our tensors
        self._next_quorum = (self.step + 1, self._ask(None, step=self.step + 1))

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
            self._catch_up.settle()

    def process_group(self) -> Any:
        """A ``torch.distributed`` process group over the replicas, for gradients only.

        ``dist.all_reduce(t, group=pg)`` (``SUM`` or ``AVG`` over the contributing replicas)
        and FSDP2's ``set_all_reduce_hook`` exchange through this step's fault-tolerant
        group; :meth:`sync_gradients` then says whether the step may commit. See
        :mod:`unbroken.train.managed_group`.
        """
        return ManagedProcessGroup(self)

    def begin_overlap(self) -> OverlappedExchange:
        """Starts this step's exchange during backward, at its first bucket (idempotent).

        Waits for the quorum (asked for when the step started). When a replica catches up this
        step, every member exchanges after the backward pass instead (``decision`` None), in
        the single buffer the catching-up replica sends early; its donor's snapshot is then
        taken there, not in the middle of a backward pass. With :attr:`catch_up_in_buckets`,
        such a step is exchanged bucket by bucket too: the catching-up replica sends zeros in
        each bucket and loads its donor's state once the step's sums are checked.
        """
        if self._overlap is not None and self._overlap.step == self.step:
            return self._overlap  # the step's later buckets, or its next backward pass
        self.start_step()
        assert self._quorum is not None
        d = self._prepare(self._answer(self._quorum))
        # A newcomer is cold in its catch-up step (first forward and backward) and the one after
        # (its first optimizer step on the loaded state): both wait with the start-up deadline.
        cold, self._after_catch_up = bool(d.behind) or self._after_catch_up, bool(d.behind)
        if (d.behind and not self.catch_up_in_buckets) or not self.group.overlaps:
            self._overlap = OverlappedExchange(None, step=self.step)
            return self._overlap
        # A donor snapshots after the backward pass (_overlap_agreed), not here in its first
        # bucket: mid-backward, FSDP2's modules hold their unsharded parameters, and a state_dict
        # read then is not the state the newcomer must load (its fused QKV came out wrong).
        d = self._await_quorum(None, donate=not d.behind)
        behind = self.config.replica_id in d.behind_set
        self._overlap = OverlappedExchange(
            d,
            step=self.step,
            skip=False if behind else self._sits_out(),
            zero=behind,
            deadline_s=self.deadline.initial_s if cold else None,
        )
        return self._overlap

    def start_bucket(self, buf: torch.Tensor) -> None:
        """Starts summing one bucket: ``buf`` holds its gradients and ``METADATA`` free slots.

        Every member starts the same buckets in the same order. After a failure nothing more is
        started; the buffers of the step are then never used again.
        """
        o = self.begin_overlap()
        if o.decision is None or o.failed:
            return
        self._exchanger.start_bucket(o, buf, self.step, 4 * (self._grad_numel or 0))

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
        return self._exchanger.wait_buckets(o, self.step, last)

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
            if self.redo_failed_steps or self._take_veto():
                self._overlap_failed(o)
                o.outcome = False
                return False
            self.stats["exchange_failures"] += 1
            o.outcome = self._allreduce(grads, failed=o.decision.epoch)
            return o.outcome
        finally:
            self._catch_up.settle()  # a donor's copy is complete before any optimizer steps

    def _overlap_agreed(self, o: OverlappedExchange) -> bool:
        """Whether the step exchanged during backward may be applied: every bucket summed and
        checked, some replica contributed, and every rank of this replica agrees. A replica
        that caught up in the buckets (``o.zero``) then loads its donor's state."""
        assert o.decision is not None
        if o.decision.behind and not o.zero:  # the backward pass is over: a donor snapshots now
            self._catch_up.donate(o.decision, self.step, self._local_state)
        ok = self._vote(self.wait_buckets() and o.contributing > 0 and (not o.zero or self._catch_up.fetched()))
        if ok and o.zero:
            self.step = self._catch_up.finish(o.decision, self._states.load)
        return ok

    def _overlap_failed(self, o: OverlappedExchange) -> None:
        """A step exchanged during backward failed: its redo asks for a quorum without that epoch."""
        if o.decision is None or (o.contributing == 0 and not o.failed):
            return
        self.stats["exchange_failures"] += 1
        self._quorum = self._ask(o.decision.epoch)

    def _allreduce(self, grads: list[torch.Tensor], failed: int | None = None) -> bool:
        for _ in range(self.max_attempts):
            decision = self._await_quorum(failed)
            behind = self.config.replica_id in decision.behind
            if self.fault_hook is not None:
                self.fault_hook.before_exchange(self.step, decision.members, 4 * sum(g.numel() for g in grads), grads)
            if failed is None:  # this rank's own time for the step, without waiting for peers
                self.client.compute_s = time.perf_counter() - self._compute_t0
            exchanged = self._exchange(grads, decision, zero=behind)
            ok = self._vote(exchanged and (not behind or self._catch_up.fetched()))
            if ok:
                if behind:
                    self.step = self._catch_up.finish(decision, self._states.load)
                return True
            failed = decision.epoch
            self.stats["exchange_failures"] += 1
            # The loop redoes the step with batches for the next quorum; a vetoed step's
            # gradients are not to be used again.
            if self.redo_failed_steps or self._take_veto():
                self._quorum = self._ask(failed)
                return False
        log.error("step %d: no exchange succeeded in %d attempts; skipping it", self.step, self.max_attempts)
        return False

    def report(self, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Hands this step's loss and gradient norm to the diagnosis (call before the exchange).

        A non-finite value makes this replica sit the step out (it contributes no gradient) when
        the anomaly policy says ``skip_step``; the value also reaches the coordinator's detectors.
        """
        self._metrics = (loss, grad_norm)

    def report_error(self, error: BaseException | None) -> None:
        """Vetoes this step's commit: this replica's vote is no, whatever its exchange says.

        For an error the Manager cannot see (say, a side computation failed and the gradients
        may be corrupt; torchft's ``report_error``). Every rank of the replica then skips the
        step, since the vote is a MIN over its ranks; the step is redone as any failed one.
        The veto holds for one vote; None withdraws one that was not voted on yet.
        """
        self._error = error

    @property
    def errored(self) -> BaseException | None:
        """The error reported for the step whose vote has not run yet, else None."""
        return self._error

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
        self._catch_up.own_state = None  # trained without catching up: nothing to receive into
        self.step += 1
        self._catch_up.prewarm(self._local_state)

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
        if self._on_shutdown is not None:
            self._on_shutdown()

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
        self._states.register(key, load_state_dict, state_dict)

    # -- internals -----------------------------------------------------------------------

    def _request_quorum(self, failed_epoch: int | None, step: int | None = None) -> Future[dict[str, Any]]:
        """Asks for this step's quorum (again, after ``failed_epoch``); the attempt begins now.

        ``step``: the next step's, asked for before this one is committed (request_next_quorum);
        that step's attempt begins then (this step's vote, the last use of the old time, is over)."""
        self._step_began = time.monotonic()
        failure = self.group.last_failure
        error = failure[1] if failure is not None and failed_epoch is not None and failure[0] == failed_epoch else None
        return self.client.request_quorum(self.step if step is None else step, failed_epoch, self._step_time, error)

    def _ask(self, failed_epoch: int | None, step: int | None = None) -> Future[dict[str, Any]]:
        """:meth:`_request_quorum`, whose answer is acted on as it arrives when preparing early."""
        fut = self._request_quorum(failed_epoch, step)
        if self.prepare_early:
            fut.add_done_callback(self._prepare_soon)
        return fut

    def _await_quorum(self, failed_epoch: int | None, donate: bool = True) -> QuorumDecision:
        if failed_epoch is not None or self._quorum is None:
            self._quorum = self._request_quorum(failed_epoch)
        fut, self._quorum = self._quorum, None
        msg = self._answer(fut)
        d = self._prepare(msg)
        if donate:
            self._catch_up.donate(d, self.step, self._local_state)
        self.decision = d
        return d

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
            # (Exchanging in buckets, a catching-up replica sends zeros in each bucket instead.)
            numel = None if self.catch_up_in_buckets else self._grad_numel
            if self._catch_up.plan(d, msg.get("transfer_addrs", {})) and numel is not None:
                self._catch_up.start_early_exchange(self.group, d, numel, self.deadline.seconds, self.device)
        return d

    def _local_state(self) -> dict[str, Any]:
        """What a peer is sent: every registered state and the step, DTensors as this rank's local shards."""
        return as_local(self._states.full(self.step))

    def state_dict(self) -> dict[str, Any]:
        """This replica's whole state: every registered state and its step.

        What a checkpoint must hold for a resumed or rolled-back replica to rejoin at the
        right step; the same thing a donor sends a recovering peer. DTensors come as
        :class:`~unbroken.checkpoint.Shard` markers of this rank's local piece, which the
        Checkpointer stores with their place in the global tensor. Call between steps.
        """
        return as_shards(self._states.full(self.step))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned (say, from a checkpoint); call between steps."""
        self.step = self._states.load(state)

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

    def _exchange(self, grads: list[torch.Tensor], d: QuorumDecision, zero: bool) -> bool:
        early = self._catch_up.take_early_exchange(d.epoch)
        skip = False if zero else self._sits_out()
        return self._exchanger.allreduce(grads, d, self.step, zero=zero, skip=skip, early=early)

    def _sits_out(self) -> bool:
        """Whether this replica sits the step out (its loss or gradient norm is not finite and
        the anomaly policy says ``skip_step``): it then contributes no gradient."""
        skip = wants_skip(*self._metrics, self.anomaly_policy)
        if skip:
            if self.recorder is not None:
                self.recorder.record_step(self.step, *self._metrics, None)
            log.warning("replica %d step %d: %s, sitting this step out", self.config.replica_id, self.step, skip)
        return bool(skip)

    def _epoch_superseded(self, step: int) -> bool:
        """Whether the coordinator aborted the epoch of this step's exchange before its peers
        applied ``step`` (:mod:`unbroken.train.step.vote`). An epoch pushed with the abort that trains
        a later step says they did: a member died after the step's sum completed everywhere.
        So does a fingerprint swap that completed after the sum (:mod:`unbroken.train.step.sdc_check`):
        every member was past it, and the abort came from a member that will not commit it."""
        if self.sdc.completed(self.group.epoch, step):
            return False
        self.client.drain()
        if not self.group.superseded() or self.group.epoch is None:
            return False
        after = self.client.next_step_after(self.group.epoch)
        return after is None or after <= step

    def _take_veto(self) -> bool:
        vetoed, self._vetoed = self._vetoed, False
        return vetoed

    def _vote(self, ok: bool) -> bool:
        """Whether every rank of this replica may commit the step (:mod:`unbroken.train.step.vote`);
        a reported error (:meth:`report_error`) makes this rank's vote no, once."""
        if self._error is not None:
            log.warning(
                "replica %d step %d: vetoed by a reported error: %s", self.config.replica_id, self.step, self._error
            )
            self._error = None
            self._vetoed = True
            ok = False
        return self._voter(ok, self.step, self._step_began)
