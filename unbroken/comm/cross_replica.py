"""A cross-replica process group that can be abandoned and rebuilt without a restart.

Every quorum epoch gets a fresh ``torch.distributed`` group on a fresh store prefix. An exchange
waits on its work's future together with an abort flag (set when the coordinator pushes an
abort) and a deadline; whichever comes first ends the wait. A group whose operation was
abandoned is never used again and its buffers are never reused (the backend may still write
into them). Every group an epoch leaves behind (abandoned, failed, or replaced by the next
epoch's) is handed to a :class:`~unbroken.comm.retire.GroupReaper`, which releases it off the
training thread once its operations are over (NCCL: once aborted), so that a long or flapping
job does not keep every epoch's sockets, threads and GPU memory.

How an epoch's sum is carried is its :class:`~unbroken.comm.transport.base.Transport`'s
(:mod:`unbroken.comm.transport`): the backend's all-reduce (NCCL or Gloo, chosen per epoch by
:mod:`unbroken.comm.backend`), unbroken's CPU-driven ring, or the ICCL ring. An error is kept
with its epoch (:attr:`CrossReplicaGroup.last_failure`) so that the rank reports its text with
the failed epoch, and the coordinator can tell a configuration that can never work from a fault
(:mod:`unbroken.comm.failure`).

The groups rendezvous on the job's authenticated store (:mod:`unbroken.comm.store_client`), so nobody
without the job's secret can read or write their keys; what the backend's own connections
bind, and why they are trusted, :mod:`unbroken.comm.transport.backend_transport` says.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from unbroken.comm.recorder import FlightRecorder
from unbroken.comm.retire import GroupReaper
from unbroken.comm.store_client import AuthenticatedStore
from unbroken.comm.transport import EpochLink, Transport, make_transport
from unbroken.comm.transport.backend_transport import make_group
from unbroken.config import CrossReplicaBackend, exchange_mode
from unbroken.control.quorum.failure import MAX_FAILURE_CHARS
from unbroken.wire.auth import JobSecret

# Past the backend's timeout, by which a Gloo operation has ended (with an error): a retired
# group whose operation runs longer is stuck.
LINGER_MARGIN_S = 30.0
# Rendezvous stores kept with their idle connections: the current epoch's and a few before it.
MAX_STORES = 4


class ExchangeFailed(RuntimeError):
    """The exchange of this epoch cannot complete: a peer died, hung, or we were told to abort."""


class PendingSum:
    """A sum started by :meth:`CrossReplicaGroup.start_allreduce_sum`, not yet waited for."""

    def __init__(self, epoch: int | None, future: Any) -> None:
        self.epoch = epoch
        self.future = future  # None when the group has one member: nothing to wait for
        self.started = time.perf_counter()
        self.finished: float | None = None  # when the backend completed it (the benchmark's overlap figure)

    def done(self) -> bool:
        return self.future is None or self.future.done()


PreparedKey = tuple[str, int, tuple[int, ...], str]  # (store address, epoch, members, tag)
MAX_PREPARED = 4  # groups of forecast epochs built ahead at once, at most
MAX_STARTED_AHEAD = 64  # names of forecast epochs remembered as built (pruned by each configure)


def epoch_name(tag: str, epoch: int, members: list[int]) -> str:
    """``TAG/epochN/DIGEST``: the rendezvous keys and connections of one epoch's group, named by
    its members too, so that a group built ahead for a forecast that did not come true never
    pairs with the one the epoch formed with (:meth:`CrossReplicaGroup.prepare`)."""
    digest = hashlib.blake2b(repr(list(members)).encode(), digest_size=6).hexdigest()
    return f"{tag}/epoch{epoch}/{digest}"


class CrossReplicaGroup:
    """The reconfigurable group among the same rank of every replica in the quorum.

    Args:
        secret: the job's secret, which the store of the groups' rendezvous demands.
        timeout_s: the backend's own timeout; only bounds how long an abandoned operation
            lingers, since waits are bounded by the learned deadline.
        rendezvous_s: the longest wait for the members of a new epoch to build its group; a
            crash or hang during it is normally cut short sooner by the coordinator's abort.
        backend: ``auto``, ``nccl`` or ``gloo`` (:mod:`unbroken.comm.backend`).
        reaper: releases the groups that epochs leave behind; None makes one.
        transport: how each epoch's sum is carried (:mod:`unbroken.comm.transport`); None
            picks the one ``UNBROKEN_EXCHANGE`` names.
    """

    def __init__(
        self,
        secret: JobSecret,
        timeout_s: float = 60.0,
        rendezvous_s: float = 10.0,
        backend: str = "auto",
        reaper: GroupReaper | None = None,
        transport: Transport | None = None,
    ) -> None:
        if not isinstance(secret, JobSecret):
            raise TypeError(f"CrossReplicaGroup needs the job's JobSecret, got {type(secret).__name__}")
        CrossReplicaBackend.parse(backend, "the cross-replica backend")
        self._secret = secret
        self.backend_setting = backend
        self.backend = ""  # the backend of the current epoch's group, once built
        self.reaper = reaper or GroupReaper(linger_s=timeout_s + LINGER_MARGIN_S)
        self._works: list[Any] = []  # operations started on the current group that may still run
        self.last_failure: tuple[int | None, str] | None = None  # (epoch, error) of the last failed exchange
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rendezvous_s = rendezvous_s
        self.epoch: int | None = None
        self.rank = 0
        self.size = 1
        self._pg: Any = None
        self._pending: Future[Any] | None = None  # the group of this epoch, being built
        self._stores: OrderedDict[str, AuthenticatedStore] = OrderedDict()  # the last MAX_STORES used
        self._wake: threading.Event | None = None  # the wait in progress, one per operation
        self._batch: tuple[threading.Event, Any] | None = None  # overlapped sums: their wake, record
        self._aborted_epoch: int | None = None
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        # Groups of forecast epochs being built ahead (prepare), by (store, epoch, members, tag);
        # and every such key ever started for an epoch not yet configured: a name is built once.
        self._prepared: dict[PreparedKey, Future[Any]] = {}
        self._started_ahead: set[PreparedKey] = set()
        self.prepared_hits = 0  # epochs whose group was built ahead and taken as it was
        self.recorder: FlightRecorder | None = None
        self.members: list[int] = []
        self.last_join_wait_s = 0.0  # how long the last exchange waited for its epoch's rendezvous
        self.tag = ""
        self.transport = transport or make_transport(exchange_mode())

    def configure(
        self,
        store_address: str,
        epoch: int,
        rank: int,
        size: int,
        tag: str,
        device: torch.device,
        members: list[int] | None = None,
    ) -> None:
        """Joins the group of ``epoch``; every member calls this with the same epoch and tag.

        The group is built on a background thread: its rendezvous waits for every member, and
        a member that dies or hangs meanwhile must not hold this thread for the backend's
        timeout. The next :meth:`allreduce_sum` waits for it under the same abort and
        deadline as the exchange itself.
        """
        self.abandon()
        self._batch_over(None)  # a batch of overlapped sums left open by the last epoch
        self.members, self.tag = list(members or range(size)), tag
        self.epoch, self.rank, self.size = epoch, rank, size
        key = (store_address, epoch, tuple(self.members), tag)
        with self._prepare_lock:
            prepared = self._prepared.pop(key, None)
            started = key in self._started_ahead
            # Forecasts of this epoch or earlier ones are done with; later ones may still form.
            stale = [k for k in self._prepared if k[1] <= epoch]
            released = [self._prepared.pop(k) for k in stale]
            self._started_ahead = {k for k in self._started_ahead if k[1] > epoch}
        for pending in released:
            pending.add_done_callback(self._retire_built)
        if prepared is not None:
            self._pending = prepared  # built ahead, as forecast: its rendezvous is under way or done
            self.prepared_hits += 1
            return
        if started:  # built ahead and released since: its name cannot be met twice
            self._pending = Future()
            self._pending.set_exception(RuntimeError(f"epoch {epoch}'s group was built ahead and released"))
            return
        if size == 1:
            return
        self._pending = self._build(store_address, epoch, rank, size, tag, device, self.members)

    def prepare(
        self, store_address: str, epoch: int, members: list[int], me: int, tag: str, device: torch.device
    ) -> bool:
        """Starts building the group of an epoch the coordinator forecasts (a newcomer admitted
        at the members' next step), while this one still trains; whether a build started.

        A new epoch's rendezvous waits for every member, a newcomer's first steps among them,
        and took a survivor's whole step on 2 cores (0.05-0.07 s for 3 members against 0.015 s
        for 2); begun a step ahead, it is done by the time the epoch forms. Only a forecast:
        :meth:`configure` takes the group when the epoch forms as forecast (the same epoch
        number, members, store and tag), else it is released. Each group's rendezvous keys name
        its members (:func:`epoch_name`), so a forecast that missed never meets the real epoch.
        Called from the coordinator connection's thread.
        """
        if me not in members or len(members) < 2:
            return False
        key = (store_address, epoch, tuple(members), tag)
        with self._prepare_lock:
            if (self.epoch is not None and epoch <= self.epoch) or key in self._started_ahead:
                return False
            if len(self._prepared) >= MAX_PREPARED:  # forecasts that keep changing: keep the newest
                oldest = min(self._prepared, key=lambda k: k[1])
                self._prepared.pop(oldest).add_done_callback(self._retire_built)
            if len(self._started_ahead) >= MAX_STARTED_AHEAD:  # a replica no epoch takes in
                self._started_ahead.discard(min(self._started_ahead, key=lambda k: k[1]))
            self._started_ahead.add(key)
            self._prepared[key] = self._build(
                store_address, epoch, members.index(me), len(members), tag, device, members
            )
        return True

    def _build(
        self, store_address: str, epoch: int, rank: int, size: int, tag: str, device: torch.device, members: list[int]
    ) -> Future[Any]:
        """The group of ``epoch``, built on a background thread: its rendezvous waits for every
        member, and a member that dies or hangs meanwhile must not hold the caller."""
        pending: Future[Any] = Future()
        try:
            store = self._store(store_address)  # here, not on the build thread: the pool keeps epochs in order
        except ValueError as e:  # an address that is no HOST:PORT: this epoch's exchange fails with it
            pending.set_exception(e)
            return pending
        name = epoch_name(tag, epoch, members)

        def build() -> None:
            try:
                prefix = dist.PrefixStore(f"unbroken/{name}", store)
                link = EpochLink(
                    prefix,
                    store_address,
                    rank,
                    size,
                    device,
                    name,
                    self._secret,
                    self.backend_setting,
                    self.timeout,
                    self.rendezvous_s,
                    self.reaper,
                )
                pending.set_result(self.transport.build(link))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting exchange
                pending.set_exception(e)

        threading.Thread(target=build, name=f"unbroken-group-epoch{epoch}", daemon=True).start()
        return pending

    def make_group(
        self, backend: str, store: Any, rank: int, size: int, store_address: str, device: torch.device
    ) -> Any:
        """A torch process group of ``backend`` on ``store``, with this group's timeout and reaper."""
        return make_group(backend, store, rank, size, store_address, device, self.timeout, self.reaper)

    def abandon(self) -> None:
        """Stops using the current group (its operation or rendezvous may still be running); the
        reaper releases it once its operations are over."""
        if self._pending is not None:
            self._pending.add_done_callback(self._retire_built)
            self._pending = None
        pg, self._pg = self._pg, None
        works, self._works = self._works, []
        if pg is not None:
            self.transport.release(self.reaper, pg, self.backend, self.epoch, works)
        del pg
        self.epoch = None

    def _retire_built(self, pending: Future[Any]) -> None:
        """A group whose rendezvous completed after its epoch was abandoned: nothing ran on it."""
        if pending.exception() is None:
            backend, pg = pending.result()
            self.transport.release(self.reaper, pg, backend, None, [])

    def abort(self, epoch: int) -> None:
        """Called from the coordinator connection's thread: ends a wait on ``epoch`` now."""
        with self._lock:
            self._aborted_epoch = epoch
            if self.epoch == epoch and self._wake is not None:
                self._wake.set()

    def superseded(self) -> bool:
        """Whether the coordinator has aborted the current epoch (or a later one).

        Read before a step whose sum completed is committed: a peer that gave up on the
        exchange (its deadline, or an abort) leaves its backend operation running, and a late
        member's call can still pair with it and complete; that peer redoes the step in the next
        epoch, so this member must not apply it."""
        with self._lock:
            aborted = self._aborted_epoch
            return self.epoch is not None and aborted is not None and aborted >= self.epoch

    def allreduce_sum(
        self, tensor: torch.Tensor, deadline_s: float, op: Any = None, abortable: bool = True, recorded: bool = True
    ) -> float:
        """Sums ``tensor`` in place across the group; returns the seconds it took.

        ``op``: another ``dist.ReduceOp`` (MAX, MIN, PRODUCT) for a side collective that is
        not a gradient (torchft's loss and token counts); the exchange itself always sums.
        ``abortable=False``: the coordinator's abort of the epoch does not end the wait, only
        completion, a backend error or the deadline do (the exchange check's fingerprint swap: a
        member that will not commit reports the epoch failed once its own swap is done, while
        its peers may still be receiving theirs).
        ``recorded=False``: the flight recorder does not see it as a collective: its time is
        added to the group's last one (the fingerprint swap right after the exchange). In the
        cluster box a tbf-slowed link was named in 14 steps without the swap; with the swap as a
        collective of its own (a few bytes, halving every link's evidence), not within 30; with
        its time counted as compute, in 31 steps or not at all; added to the exchange, in 16 and 25.

        Raises:
            ExchangeFailed: a peer failed, the deadline passed, or the coordinator aborted
                this epoch. The tensor's contents are then undefined and it must not be
                reused.
        """
        if self.size == 1:
            return 0.0
        if self._pg is None and self._pending is None:
            raise self._failed(self.epoch, "no group: this epoch was abandoned")
        epoch = self.epoch
        start = time.perf_counter()
        wake = threading.Event()
        with self._lock:
            if abortable and self._aborted_epoch == epoch:
                raise self._aborted(epoch)
            self._wake = wake if abortable else None
        self.last_join_wait_s = 0.0
        if self._pg is None:
            self._join_group(wake, max(deadline_s, self.rendezvous_s))
            self.last_join_wait_s = time.perf_counter() - start
            start = time.perf_counter()  # the learned deadline times the exchange alone
        deadline_s = max(deadline_s, getattr(self._pg, "min_deadline_s", 0.0))  # ICCL: room for a failover
        rec = self.recorder if recorded else None
        nbytes = tensor.numel() * tensor.element_size()
        token = rec.begin(f"{self.tag}/epoch{epoch}", "allreduce", nbytes, self.members) if rec else None
        ok: bool | None = False  # False: the deadline passed (a stall); None: explained failure
        try:
            fut = self._start(tensor, wake, op, rec)
            woke = wake.wait(deadline_s)
            with self._lock:
                self._wake = None
            if fut.done():
                try:
                    fut.wait()
                except Exception as e:  # the backend's error: a peer's connection closed
                    ok = None
                    self.abandon()
                    raise self._failed(epoch, f"exchange failed in epoch {epoch}: {e}") from e
                ok = True
                return time.perf_counter() - start
            self.abandon()
            if woke:
                ok = None
                raise self._failed(epoch, f"epoch {epoch} was aborted by the coordinator")
            raise self._failed(epoch, f"exchange in epoch {epoch} passed its {deadline_s:.2f}s deadline")
        finally:
            if rec is not None and token is not None:
                rec.end(token, ok)
            elif ok and not recorded and self.recorder is not None:
                self.recorder.extend_last(f"{self.tag}/epoch{epoch}")

    @property
    def overlaps(self) -> bool:
        """Whether several sums may be in flight at once (the backend's; the ring's may not)."""
        return self.transport.overlaps

    def start_side_sum(self, tensor: torch.Tensor) -> PendingSum | None:
        """Starts a small sum right behind the step's buckets and returns at once (None where it
        cannot: one member, no group yet, or a transport that does not overlap; the caller then
        sums with :meth:`allreduce_sum`). :meth:`finish_side_sum` waits for it.

        ``tensor`` is one equal row per member, zero but for this member's own (row
        :attr:`rank`): its sum is an all-gather of the rows, which the backend does with half
        the hops (:meth:`~unbroken.comm.transport.base.Transport.start_gather`).

        The exchange check's fingerprint swap starts here as soon as the step's last bucket is
        summed, so it travels while this rank ends its backward pass and clips gradients,
        instead of being a round trip of its own before the commit. Every member starts it
        after the same buckets, so the backend pairs it alike whether it starts early or late.

        Raises:
            ExchangeFailed: the backend refused it (a peer's connection closed).
        """
        pg = self._pg
        if self.size == 1 or pg is None or not self.overlaps:
            return None
        epoch = self.epoch
        try:
            held = self.transport.start_gather(pg, tensor, self.rank, self.size)
            self._track(held)
        except Exception as e:
            self.abandon()
            raise self._failed(epoch, f"exchange failed in epoch {epoch}: {e}") from e
        return PendingSum(epoch, held.future)

    def finish_side_sum(self, pending: PendingSum, deadline_s: float) -> float:
        """Waits for a sum begun by :meth:`start_side_sum`, bounded by ``deadline_s`` (from now)
        but not ended by the coordinator's abort (as ``allreduce_sum(abortable=False,
        recorded=False)``: its time is added to the group's last collective). Returns the
        seconds waited.

        Raises:
            ExchangeFailed: a peer failed or the deadline passed; the group is abandoned.
        """
        start = time.perf_counter()
        epoch = pending.epoch
        if not pending.done():
            finished = threading.Event()
            pending.future.add_done_callback(lambda _: finished.set())
            finished.wait(max(deadline_s, getattr(self._pg, "min_deadline_s", 0.0)))
        if not pending.done():
            self.abandon()
            raise self._failed(epoch, f"exchange in epoch {epoch} passed its {deadline_s:.2f}s deadline")
        try:
            pending.future.wait()
        except Exception as e:  # the backend's error: a peer's connection closed
            self.abandon()
            raise self._failed(epoch, f"exchange failed in epoch {epoch}: {e}") from e
        if self.recorder is not None:
            self.recorder.extend_last(f"{self.tag}/epoch{epoch}")
        return time.perf_counter() - start

    def start_allreduce_sum(self, tensor: torch.Tensor, deadline_s: float, nbytes_total: int = 0) -> PendingSum:
        """Starts summing ``tensor`` in place and returns at once; see :meth:`finish_allreduce_sums`.

        Several sums may be in flight (a bucket each, started while the backward pass still
        computes the next); every member must start them in the same order. The first one of a
        batch waits, bounded, for this epoch's rendezvous, and opens the flight recorder's
        record of the batch (``nbytes_total`` bytes). Only the backend's all-reduce overlaps.

        Raises:
            ExchangeFailed: as :meth:`allreduce_sum`; the batch is then over and the group,
                with the tensors of every sum already started, abandoned.
        """
        if self.size == 1:
            return PendingSum(self.epoch, None)
        if not self.overlaps:
            raise RuntimeError("overlapped sums need the backend's all-reduce, not UNBROKEN_EXCHANGE=ring")
        if self._pg is None and self._pending is None:
            self._batch_over(None)
            raise self._failed(self.epoch, "no group: this epoch was abandoned")
        epoch = self.epoch
        with self._lock:
            aborted = self._aborted_epoch == epoch
            if not aborted and self._batch is None:
                self._batch = (threading.Event(), None)
                self._wake = self._batch[0]
        if aborted:  # sums of this batch may be in flight: their group goes with them
            error = self._aborted(epoch)
            self.abandon()
            self._batch_over(None)
            raise error
        assert self._batch is not None
        wake = self._batch[0]
        if self._batch[1] is None:
            rec = self.recorder
            token = (
                rec.begin(f"{self.tag}/epoch{epoch}", "allreduce", nbytes_total or tensor.numel() * 4, self.members)
                if rec
                else None
            )
            self._batch = (wake, token)
            self.last_join_wait_s = 0.0
        if self._pg is None:
            start = time.perf_counter()
            try:
                self._join_group(wake, max(deadline_s, self.rendezvous_s))
            except ExchangeFailed:
                self._batch_over(None)
                raise
            self.last_join_wait_s = time.perf_counter() - start
            with self._lock:
                self._wake = wake
        try:
            pg = self._pg
            if pg is None:  # the coordinator's thread abandoned the group since the join
                raise self._failed(epoch, f"the group of epoch {epoch} was abandoned")
            held = self.transport.start_overlapped(pg, tensor)
            fut = held.future
            self._track(held)
        except Exception as e:  # a peer's connection closed before this started
            self.abandon()
            self._batch_over(None)
            raise self._failed(epoch, f"exchange failed in epoch {epoch}: {e}") from e
        pending = PendingSum(epoch, fut)

        def done(_: Any) -> None:
            pending.finished = time.perf_counter()
            wake.set()

        fut.add_done_callback(done)
        return pending

    def finish_allreduce_sums(self, pending: list[PendingSum], deadline_s: float, last: bool = True) -> float:
        """Waits for ``pending`` sums, bounded by the deadline and the coordinator's abort.

        ``last``: they end the batch (its flight record closes); otherwise more may follow.
        Returns the seconds waited here (what remained of the exchange once the caller had
        nothing else to do). The tensors of the batch are undefined after a failure and must
        not be reused.

        Raises:
            ExchangeFailed: a peer failed, the deadline passed, or the coordinator aborted.
        """
        start = time.perf_counter()
        if self.size == 1 or not pending:
            if last:
                self._batch_over(True)
            return 0.0
        epoch = pending[0].epoch
        batch = self._batch
        if batch is None or epoch != self.epoch:
            self._batch_over(None)
            raise self._failed(epoch, f"epoch {epoch} was abandoned while its sums were in flight")
        wake = batch[0]
        end = start + max(deadline_s, getattr(self._pg, "min_deadline_s", 0.0))  # ICCL: room for a failover
        ok: bool | None = False
        try:
            while True:
                wake.clear()
                if all(p.done() for p in pending):
                    break
                with self._lock:
                    aborted = self._aborted_epoch == epoch
                if aborted:
                    ok = None
                    self.abandon()
                    raise self._failed(epoch, f"epoch {epoch} was aborted by the coordinator")
                left = end - time.perf_counter()
                if left <= 0:
                    self.abandon()
                    raise self._failed(epoch, f"exchange in epoch {epoch} passed its {deadline_s:.2f}s deadline")
                wake.wait(left)
            for p in pending:
                try:
                    p.future.wait()
                except Exception as e:  # the backend's error: a peer's connection closed
                    ok = None
                    self.abandon()
                    raise self._failed(epoch, f"exchange failed in epoch {epoch}: {e}") from e
            ok = True
            return time.perf_counter() - start
        finally:
            if last or not ok:
                self._batch_over(ok)

    def _batch_over(self, ok: bool | None) -> None:
        batch, self._batch = self._batch, None
        with self._lock:
            self._wake = None
        if batch is not None and batch[1] is not None and self.recorder is not None:
            self.recorder.end(batch[1], ok)

    def _start(
        self, tensor: torch.Tensor, wake: threading.Event, op: Any = None, recorder: FlightRecorder | None = None
    ) -> Any:
        """Starts the sum (or ``op``); returns what ``wake`` is set on when it is done. The
        transport records its transfers in ``recorder`` (None: nobody's)."""
        run = self.transport.start(self._pg, tensor, self.rank, self.size, wake, op, recorder)
        self._track(run)
        return run

    def _join_group(self, wake: threading.Event, timeout_s: float) -> None:
        """Waits for this epoch's rendezvous, bounded like an exchange."""
        pending, epoch = self._pending, self.epoch
        assert pending is not None
        pending.add_done_callback(lambda _: wake.set())
        wake.wait(timeout_s)
        if not pending.done():
            with self._lock:
                self._wake = None
            self.abandon()
            raise self._failed(
                epoch, f"epoch {epoch}: the group's rendezvous did not complete in {timeout_s:.1f}s or was aborted"
            )
        self._pending = None
        try:
            self.backend, self._pg = pending.result()
        except Exception as e:
            with self._lock:
                self._wake = None
            self.abandon()
            raise self._failed(epoch, f"epoch {epoch}: building the group failed: {e}") from e
        wake.clear()
        with self._lock:
            if self._aborted_epoch == epoch:
                self._wake = None
                self.abandon()
                raise self._failed(epoch, f"epoch {epoch} was aborted by the coordinator")

    def _failed(self, epoch: int | None, error: str) -> ExchangeFailed:
        """Remembers the error of ``epoch`` (reported with the next quorum request) and returns it."""
        self.last_failure = (epoch, error[:MAX_FAILURE_CHARS])
        return ExchangeFailed(error)

    def _aborted(self, epoch: int | None) -> ExchangeFailed:
        """The coordinator aborted ``epoch``, most likely because a peer reported it failed: when
        this member's own build failed too, that error is the one to report (all members failing
        the same way is what tells a configuration error from a fault)."""
        pending = self._pending
        if pending is not None and pending.done() and pending.exception() is not None:
            return self._failed(epoch, f"epoch {epoch}: building the group failed: {pending.exception()}")
        return self._failed(epoch, f"epoch {epoch} was aborted by the coordinator")

    def _track(self, work: Any) -> None:
        """Keeps an operation started on the current group until it is over (what the reaper waits
        for when the group is retired); those already over are dropped, so the list stays short."""
        self._works = [w for w in self._works if not w.done()]
        self._works.append(work)

    def close(self, timeout_s: float = 0.0) -> None:
        """Leaves the current epoch and waits up to ``timeout_s`` for the groups to be released."""
        self.abandon()
        with self._prepare_lock:
            prepared, self._prepared = list(self._prepared.values()), {}
        for pending in prepared:
            pending.add_done_callback(self._retire_built)
        if timeout_s > 0:
            self.reaper.drain(timeout_s)

    def _store(self, address: str) -> AuthenticatedStore:
        """The store at ``address``, with its pooled connections. Each epoch's groups may meet on
        another node's store (the leader's, turned with the epoch): only the :data:`MAX_STORES`
        used last are kept, and the idle connections of the others closed, so a long job holds
        no connection to every store it ever met on (nor do those stores hold one to it)."""
        with self._store_lock:
            store = self._stores.pop(address, None)
            if store is None:
                store = AuthenticatedStore(address, self._secret, timeout=datetime.timedelta(seconds=30))
            self._stores[address] = store
            while len(self._stores) > MAX_STORES:
                self._stores.popitem(last=False)[1].close()
            return store
