"""torchft's ``Manager`` over unbroken's: the same calls, unbroken's quorums and catch-up.

A torchft loop (torchtitan's ``FaultTolerantTrainer``, torchft's ``train_ddp.py``) drives its
Manager as ``start_quorum()`` at ``zero_grad``, ``allreduce(tensor)`` per gradient bucket, and
``should_commit()`` before the optimizer steps. Here each call maps onto a step of
:class:`unbroken.train.manager.Manager`:

- ``start_quorum`` is ``start_step``: the quorum request travels while the forward pass runs;
  with ``use_async_quorum=False`` it also waits for the answer.
- ``allreduce(tensor)`` (SUM or AVG of a float tensor, between ``start_quorum`` and
  ``should_commit``) is one bucket of the step's fault-tolerant exchange (the path of
  ``manager.process_group()``); after ``work.wait()`` the tensor holds the sum or the average
  over the participating replicas, in every step: in one where a replica catches up, the
  newcomer sends zeros in each bucket (``catch_up_in_buckets``). Only where the exchange cannot
  overlap (``UNBROKEN_EXCHANGE=ring``) is such a step exchanged at its end, by
  ``should_commit`` (into the tensors given to ``allreduce``, or, under the ``Optimizer``
  wrapper, into the parameters' gradients). Any other all-reduce (MAX, MIN, integers, or
  outside that window: torchtitan's loss and token counts) runs on the current quorum's group
  as a plain collective, bounded by the same deadline and abort.
- ``should_commit`` is ``sync_gradients`` (the replica vote: every rank of the replica or
  none) and ``commit``. ``report_error`` vetoes it (unbroken's ``Manager.report_error``),
  as do fewer participants than ``min_replica_size``.
- A restarted replica is caught up by unbroken (a zero contribution, then a donor's state at
  the step's end), which is torchft's healing with ``use_async_quorum=True``. ``init_sync``
  makes every replica take the lowest-numbered one's state in the first step, so replicas
  start identical without a shared seed.

The Manager joins the job that ``unbroken run`` launched (``unbroken.init()``); the store,
lighthouse and port arguments of torchft's are accepted and unused: the coordinator does what
torchft's lighthouse and manager server do. Tests pass ``manager=``, an unbroken Manager built
with stand-ins.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm.cross_replica import ExchangeFailed
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.torchft.init_sync import as_like, broadcast_by_sum, local_tensors, sync_source
from unbroken.torchft.process_group import FakeProcessGroupWrapper, backend_of
from unbroken.train.managed_group import ManagedProcessGroup as ExchangeGroup
from unbroken.train.manager import Manager as UnbrokenManager

log = logging.getLogger(__name__)

STATE_KEY = "torchft"  # the Manager's own counters in the state a recovering replica fetches


class WorldSizeMode(enum.Enum):
    """torchft's world-size modes. unbroken trains with every live replica (``DYNAMIC``);
    ``FIXED_WITH_SPARES`` is not supported."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class Manager:
    """torchft's Manager, run by unbroken's (see the module's docstring for the mapping).

    Args (torchft's; those marked unused are accepted so that scripts run unchanged):
        pg: which backend the replicas exchange over (``ProcessGroupGloo``, ``ProcessGroupNCCL``
            and the Baby variants); unbroken builds the group per quorum epoch.
        load_state_dict, state_dict: the state a recovering replica fetches, registered as
            ``"default"``; more with :meth:`register_state_dict_fn`.
        min_replica_size: a step commits only with at least this many participants (the job's
            own ``--min-replicas`` also holds).
        use_async_quorum: False waits for the quorum in :meth:`start_quorum`.
        quorum_timeout, connect_timeout: how long to wait for a quorum, and for the coordinator.
        timeout: unused: waits are bounded by unbroken's learned deadline and the coordinator's
            abort, not a fixed timeout.
        init_sync: every replica takes the lowest-numbered one's state in the first step.
        max_retries: raise after this many consecutive steps that did not commit.
        rank, world_size, store_addr, store_port, lighthouse_addr, replica_id, port, hostname,
        heartbeat_interval, checkpoint_transport, quorum_retries, world_size_mode: unused;
            ``unbroken run`` places the rank and the coordinator stands for the lighthouse.
        manager: an unbroken Manager to drive (tests); None joins the job with ``unbroken.init()``.
    """

    def __init__(
        self,
        pg: Any = None,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        connect_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: datetime.timedelta = datetime.timedelta(milliseconds=100),
        checkpoint_transport: Any = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        *,
        manager: UnbrokenManager | None = None,
    ) -> None:
        if world_size_mode != WorldSizeMode.DYNAMIC:
            raise NotImplementedError("unbroken trains with every live replica: only WorldSizeMode.DYNAMIC")
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        joined = manager is None
        if manager is None:
            manager = _join(pg, quorum_timeout, connect_timeout, lighthouse_addr, replica_id, rank, world_size)
        self._manager = manager
        # A failed step goes back to the loop, as in torchft: should_commit says False and the
        # next zero_grad() asks for a quorum without the failed epoch.
        manager.redo_failed_steps = True
        # torchft's allreduce(t).wait() leaves the average in t in every step: a step in which a
        # replica catches up is exchanged bucket by bucket as well, the newcomer sending zeros.
        manager.catch_up_in_buckets = True
        # A torchft loop's state_dict() may hand cached buffers it rewrites on each call
        # (torchtitan's model and optimizer wrappers): a catch-up fetches into fresh memory.
        manager.fetch_in_place = False
        self._pg = pg
        self._replica_id = replica_id
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._timeout = timeout
        self._max_retries = max_retries
        self._commit_failures = 0
        self._batches_committed = 0
        self._errored: Exception | None = None
        self._in_step = False  # between start_quorum and should_commit
        self._started = False  # a quorum was ever asked for
        self._tensors: list[torch.Tensor] = []  # given to allreduce this step
        self._works: list[dist.Work] = []
        self._init_sync = init_sync
        if init_sync:  # the replicas' states differ until the first step's sync
            manager.sdc.weights_from_step = max(manager.sdc.weights_from_step, 1)
        self._exchange = ExchangeGroup(manager)
        self._user_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        manager.register_state_dict_fn(STATE_KEY, self._load_counters, self._counters)
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        # torchft's users often never call shutdown() (torchtitan's trainer does not): a torchft
        # replica just stops heartbeating. Here the interpreter's teardown (seconds of garbage
        # collection on a busy host, heartbeats stopped) would read as a hang, and the replica be
        # restarted: leave the job at exit instead, as finished unless an exception ended it.
        if joined:
            atexit.register(self._leave_at_exit)

    # -- state -------------------------------------------------------------------------------

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds ``key`` to what a recovering replica fetches from a donor (before the first step).

        ``load_state_dict`` gets DTensors where ``state_dict`` returns them (unbroken sends their
        local shards; :func:`~unbroken.torchft.init_sync.as_like` makes them DTensors again).
        """

        def load(received: Any) -> None:
            load_state_dict(as_like(received, state_dict()))

        self._manager.register_state_dict_fn(key, load, state_dict)
        self._user_fns[key] = (load_state_dict, state_dict)

    def set_state_dict_fns(self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]) -> None:
        """torchft's older form of :meth:`register_state_dict_fn`, under one key."""
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """A no-op: unbroken reads the state only on the training thread, between steps."""

    def disallow_state_dict_read(self) -> None:
        """A no-op, as :meth:`allow_state_dict_read`."""

    def state_dict(self) -> dict[str, int]:
        """The Manager's counters, for a checkpoint: the step and the batches committed."""
        return {"step": self._manager.step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores :meth:`state_dict` (from a checkpoint; call between steps)."""
        self._manager.step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def _manager_state_dict(self) -> dict[str, Any]:
        """What a recovering replica receives, in torchft's layout (torchft's tests read it)."""
        return {"user": {k: fn() for k, (_, fn) in self._user_fns.items()}, "torchft": self.state_dict()}

    def _counters(self) -> dict[str, int]:
        return {"batches_committed": self._batches_committed}

    def _load_counters(self, state: dict[str, int]) -> None:
        self._batches_committed = int(state["batches_committed"])  # the step comes with unbroken's state

    # -- the step -----------------------------------------------------------------------------

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: datetime.timedelta | None = None
    ) -> None:
        """Starts a step: asks for its quorum (the answer travels while the forward pass runs)."""
        self._errored = None
        self._tensors = []
        self._works = []
        self._in_step = True
        self._started = True
        self._manager.start_step()
        if not self._use_async_quorum:
            self.wait_quorum()

    def wait_quorum(self) -> None:
        """Waits for this step's quorum; the group of its epoch is then being built."""
        if not self._started:
            raise RuntimeError("must call start_quorum before wait_quorum")
        if self._in_step and self._manager.quorum_pending:
            self._manager.wait_quorum()

    def _decision(self) -> QuorumDecision | None:
        """The decision of the step in progress (waiting for it), else of the last one."""
        if self._in_step and self._manager.quorum_pending:
            return self._manager.wait_quorum()
        return self._manager.decision  # the exchange took the step's answer (DDP: in backward)

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = dist.ReduceOp.AVG
    ) -> dist.Work:
        """All-reduces ``tensor`` in place across the participating replicas; returns a Work.

        Errors are not raised: the Manager notes them and :meth:`should_commit` says no.
        ``should_quantize`` is ignored (unbroken exchanges float32).
        """
        if reduce_op == dist.ReduceOp.AVG and not torch.is_floating_point(tensor):
            raise ValueError("average reduce op is only supported for floating point tensors")
        if isinstance(self._pg, FakeProcessGroupWrapper) and (injected := self._pg.take_future_error()) is not None:
            self.report_error(injected)  # torchft's tests fail an all-reduce this way
        # ``==`` with the op on the left: torch's ``ReduceOp`` (what ``dist.all_reduce`` passes in its
        # options) equals a ``RedOpType`` only that way round, so ``op in (SUM, AVG)`` is False.
        summed = reduce_op == dist.ReduceOp.SUM or reduce_op == dist.ReduceOp.AVG
        if self._in_step and summed and torch.is_floating_point(tensor):
            self._tensors.append(tensor)
            opts = dist.AllreduceOptions()
            opts.reduceOp = reduce_op
            work = _TensorWork(self._exchange.allreduce([tensor], opts), tensor)
            self._works.append(work)
            return work
        self._side_allreduce(tensor, reduce_op)
        return _TensorWork(None, tensor)

    def _side_allreduce(self, tensor: torch.Tensor, reduce_op: Any) -> bool:
        """A collective that is not the gradient exchange, on the current quorum's group.

        Every member runs the same collectives in the same order on the epoch's group (a
        catching-up replica exchanges in buckets, never in a separate early exchange, see
        ``catch_up_in_buckets``), so this pairs with the same call of every peer. Returns
        whether the tensor holds the reduction.
        """
        d = self._decision()
        m = self._manager
        if d is None or len(d.members) < 2:
            return True
        if m.group.epoch != d.epoch:
            return False
        op = dist.ReduceOp.SUM if reduce_op == dist.ReduceOp.AVG else reduce_op
        buf = tensor.detach().clone()
        try:
            m.group.allreduce_sum(buf, m.deadline.seconds, op=op)
        except (ExchangeFailed, ValueError, RuntimeError) as e:
            log.warning("an all-reduce outside the gradient exchange failed, keeping the local value: %s", e)
            return False
        if reduce_op == dist.ReduceOp.AVG:
            buf /= len(d.members)
        tensor.detach().copy_(buf)
        return True

    def report_error(self, e: Exception) -> None:
        """Vetoes this step: :meth:`should_commit` returns False on every rank of this replica."""
        self._errored = e

    def errored(self) -> Exception | None:
        """The error reported in this step, else None."""
        return self._errored

    def wrap_future(self, fut: Any, default: Any, timeout: datetime.timedelta | None = None) -> Any:
        """``fut`` whose error is reported (and ``default`` returned) instead of raised."""

        def callback(f: Any) -> Any:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001 - torchft's contract: reported, not raised
                self.report_error(e)
                return default

        return fut.then(callback)

    def should_commit(self, timeout: datetime.timedelta | None = None) -> bool:
        """Ends the step: True when every rank of this replica may step the optimizer."""
        return self._commit(self._tensors)

    def _commit(self, grads: list[torch.Tensor]) -> bool:
        """:meth:`should_commit`, writing a deferred average into ``grads`` (see the module)."""
        m = self._manager
        if not self._in_step:
            raise RuntimeError("must call start_quorum before should_commit")
        for w in self._works:
            w.wait()
        veto: Exception | None = self._errored
        d = self._decision()
        members = len(d.members) if d is not None else 1
        # Members, not contributors: a replica catching up commits this step with the others
        # (torchft's sync quorum counts it too), so it must not hold the step back.
        if veto is None and members < self._min_replica_size:
            veto = RuntimeError(f"fewer than min_replica_size={self._min_replica_size} replicas in the quorum")
        if veto is not None:
            m.report_error(veto)
        ok = m.sync_gradients(grads)
        if veto is not None and m.errored is not None:
            m.report_error(None)  # the vote ran during backward (DDP): not this step's to veto later
            ok = False
        if ok and self._init_sync:
            ok = self._sync_first_state()
        self._in_step = False
        self._tensors, self._works = [], []
        if ok:
            m.commit()
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
            return True
        self._commit_failures += 1
        if self._max_retries is not None and self._commit_failures > self._max_retries:
            raise RuntimeError(
                f"should_commit failed {self._commit_failures} times consecutively, "
                f"exceeding max_retries={self._max_retries}"
            )
        return False

    def _sync_first_state(self) -> bool:
        """``init_sync``: in the first step, every replica takes the lowest-numbered one's state.

        After the exchange and before the optimizer steps, so the averaged gradient is applied
        to the same parameters everywhere. Every member of an epoch with no replica catching up
        is at the same step, so all of them do this (or none). Each registered state is summed in
        place and then given to its ``load_state_dict``: the tensors of a ``state_dict()`` may be
        copies. False when a sum failed: the step is then not committed, and the next one tries
        again.
        """
        m = self._manager
        d = m.decision
        source = sync_source(d.members, d.behind) if d is not None and m.step == 0 else None
        if source is None:  # past the first step, caught up from a donor, or alone
            self._init_sync = False
            return True
        me = m.config.replica_id
        synced = []
        for load_state_dict, state_dict in self._user_fns.values():
            state = state_dict()
            for t in local_tensors(state):
                buf = broadcast_by_sum(t, me == source)
                try:
                    m.group.allreduce_sum(buf, m.deadline.seconds)
                except ExchangeFailed as e:
                    log.warning("init_sync failed, trying again next step: %s", e)
                    return False
                t.detach().copy_(buf)
            synced.append((load_state_dict, state))
        # A state_dict() may hand copies, not the parameters (torchtitan's fused QKV splits its
        # weight into wq/wk/wv): load what was received, as a recovering replica would.
        for load_state_dict, state in synced:
            load_state_dict(state)
        self._init_sync = False
        return True

    # -- where this replica stands --------------------------------------------------------------

    def current_step(self) -> int:
        """Steps committed (incremented by a True :meth:`should_commit`)."""
        return self._manager.step

    def batches_committed(self) -> int:
        """Batches committed across all replicas and steps (participants summed per step)."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank among those contributing this step; None while it catches up."""
        if not self._started:
            return None
        d = self._decision()
        me = self._manager.config.replica_id
        if d is None:
            return 0
        if me in d.behind_set:
            return None
        return [r for r in d.members if r not in d.behind_set].index(me)

    def num_participants(self) -> int:
        """How many replicas contribute this step (0 before the first quorum)."""
        if not self._started:
            return 0
        d = self._decision()
        return d.contributing if d is not None else 1

    def is_participating(self) -> bool:
        """Whether this replica contributes this step (False while it catches up)."""
        return self.participating_rank() is not None

    def shutdown(self, wait: bool = True) -> None:
        """Leaves the job as a finished replica."""
        atexit.unregister(self._leave_at_exit)
        self._manager.shutdown()

    def _leave_at_exit(self) -> None:
        """At interpreter exit: an uncaught exception (``sys.last_value``) leaves as failed."""
        self._manager.shutdown(finished=getattr(sys, "last_value", None) is None)


class _TensorWork(dist.Work):
    """torchft's work: ``wait()`` leaves the result in the tensor, and the future holds it."""

    def __init__(self, inner: dist.Work | None, tensor: torch.Tensor) -> None:
        super().__init__()
        self._inner, self._tensor = inner, tensor

    def wait(self, timeout: Any = None) -> bool:
        if self._inner is not None:
            self._inner.wait()
            self._inner = None
        return True

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        self.wait()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self._tensor)
        return fut


def _join(
    pg: Any,
    quorum_timeout: datetime.timedelta,
    connect_timeout: datetime.timedelta,
    lighthouse_addr: str | None = None,
    replica_id: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> UnbrokenManager:
    """Joins the job: the one ``unbroken run`` launched this process into or, given the address
    of a lighthouse this process started (:mod:`unbroken.torchft.lighthouse`), that one's, as
    replica ``replica_id``'s trailing digits (torchft's tests run replicas as threads)."""
    from unbroken.config import ConfigError, ReplicaConfig
    from unbroken.entry import init
    from unbroken.torchft.lighthouse import DEFAULT_TOTAL_REPLICAS, coordinator_address, secret_of
    from unbroken.train.factory import build_manager

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    timeouts = {
        "quorum_timeout_s": quorum_timeout.total_seconds(),
        "connect_timeout_s": connect_timeout.total_seconds(),
        "cross_replica_backend": backend_of(pg),
    }
    secret = secret_of(lighthouse_addr) if lighthouse_addr else None
    if secret is not None:
        if (world_size or 1) > 1:
            raise NotImplementedError(
                "the ranks of one replica share its default process group: run a replica with several "
                "ranks as processes (unbroken run --ranks-per-replica), not as threads"
            )
        config = ReplicaConfig(
            coordinator=coordinator_address(lighthouse_addr or ""),
            replica_id=replica_number(replica_id),
            num_replicas=DEFAULT_TOTAL_REPLICAS,
            rank=rank or 0,
            world_size=1,
        )
        return build_manager(config=config, device=device, secret=secret, stack_dump=False, **timeouts)  # type: ignore[arg-type]
    try:
        return init(device=device, **timeouts)  # type: ignore[arg-type]
    except ConfigError as e:
        raise RuntimeError(
            f"torchft's Manager runs on unbroken here: launch the script with "
            f"`unbroken run --torchft-compat --replicas N -- python train.py` ({e})"
        ) from e


def replica_number(replica_id: str | None) -> int:
    """The replica number in torchft's replica id (its trailing digits: ``"train_ddp_1"`` is 1)."""
    digits = ""
    for ch in reversed(replica_id or ""):
        if not ch.isdigit():
            break
        digits = ch + digits
    if not digits:
        raise ValueError(f"a replica id must end in the replica's number, got {replica_id!r}")
    return int(digits)
