"""The ``Checkpointer``: what a training loop calls.

``save(step, state)`` copies the state into a reused host buffer and returns; the persist
process writes it to disk and a peer while training goes on. Two buffers alternate so that a
save never waits for the disk: while one is being written, the next snapshot goes into the
other; if a third save comes before the disk is done, it replaces the snapshot still waiting
(the newest always wins; the skipped step stays in memory only until overwritten). The disk
tier also takes at most one snapshot per ``persist_interval_s``, so that saving every step
of a fast model costs one copy per step, not a disk write per step.

With ``overlap=True`` even the copy leaves the training thread: ``save`` returns at once and
the copy runs in a helper thread while the forward and backward passes read the weights; the
first thing that would modify them must call :meth:`fence` (done for you on the optimizer by
:meth:`guard`, and by the next ``save``/``load``).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from unbroken.checkpoint.peer import PeerClient
from unbroken.checkpoint.persist import PersistProcess
from unbroken.checkpoint.snapshot import HostBuffer, Shard, copy_all, copy_into, flatten, unflatten
from unbroken.checkpoint.states import SlotState, Tier
from unbroken.checkpoint.storage import disk, history, reshard, restore
from unbroken.checkpoint.storage.manifest import (
    ShardManifest,
    TensorEntry,
    TensorSpec,
    layout,
    shard_dir_name,
    with_checksums,
)
from unbroken.wire import objects as wire_objects
from unbroken.wire.auth import JobSecret

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No checkpoint could be restored; the message lists what was tried and why it failed."""


@dataclass
class PersistOutcome:
    """What became of one step on its way to disk."""

    step: int
    ok: bool
    error: str | None = None
    durable_s: float | None = None
    peer_error: str | None = None
    nbytes: int = 0  # the snapshot's tensor bytes


@dataclass(frozen=True)
class SnapshotTaken:
    """What a :meth:`Checkpointer.save` cost the training loop: ``stall_s`` blocked, ``nbytes`` copied."""

    step: int
    stall_s: float
    nbytes: int


ReportHook = Callable[["SnapshotTaken | PersistOutcome"], None]


@dataclass
class Restored:
    """A restored state and where it came from."""

    step: int
    state: Any
    source: Tier  # compares equal to "memory", "peer" or "disk"
    skipped: list[str] = field(default_factory=list)  # newer candidates that failed, and why
    saved_world_size: int = 1


@dataclass
class _Slot:
    buffer: HostBuffer
    state: SlotState = SlotState.FREE
    step: int | None = None
    manifest: ShardManifest | None = None
    objects: bytes = b""


DEFAULT_PERSIST_INTERVAL_S = 1.0  # see the ``persist_interval_s`` argument


class Checkpointer:
    """Tiered asynchronous checkpoints for one shard (one rank of one replica).

    Args:
        directory: where checkpoints are written; created if missing; checked writable now,
            before training starts.
        keep_last: verified checkpoints kept on disk (see :mod:`~unbroken.checkpoint.storage.retention`:
            only checkpoints read back once count, and the newest verified is never deleted).
        replica, replicas, rank, world_size: this shard's place in the job, recorded so that a
            checkpoint can be loaded at another world size.
        peer: ``(host, port)`` of a :class:`~unbroken.checkpoint.peer.PeerStore` that keeps a
            copy of each committed snapshot in its memory.
        secret: the job's secret, which a peer store demands (required with ``peer``).
        owner: this shard's key at the peer (default: ``r{replica}-w{rank}``).
        overlap: run the snapshot copy in a helper thread (see module doc).
        persist_rate_mb_s: cap on disk write bandwidth, to spare shared storage.
        persist_interval_s: start writing a snapshot to disk (and to the peer) at most once per
            this many seconds; snapshots taken in between stay in memory and the newest one
            goes next. Every ``save`` is still a restorable memory snapshot, and the newest is
            durable at most about ``persist_interval_s`` plus one write later (:meth:`wait`
            writes at once). Why a cap: on a small, busy machine the persist process's CPU
            (checksums, writes, fsyncs, retention) competes with training; saving every step
            of a fast model would otherwise write to disk back to back. 0 writes as often as
            the disk keeps up.
    """

    def __init__(
        self,
        directory: str,
        keep_last: int = 3,
        *,
        replica: int = 0,
        replicas: int = 1,
        rank: int = 0,
        world_size: int = 1,
        peer: tuple[str, int] | None = None,
        secret: JobSecret | None = None,
        owner: str | None = None,
        overlap: bool = False,
        persist_rate_mb_s: float | None = None,
        persist_interval_s: float = DEFAULT_PERSIST_INTERVAL_S,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if not persist_interval_s >= 0:
            raise ValueError(f"persist_interval_s must be 0 or more seconds, got {persist_interval_s!r}")
        if not (0 <= replica < replicas and 0 <= rank < world_size):
            raise ValueError(f"replica {replica} of {replicas} / rank {rank} of {world_size} is " "out of range")
        if peer is not None and not isinstance(secret, JobSecret):
            raise ValueError(
                "a peer tier needs the job's secret: pass secret=JobSecret.required() " "(or the Manager's .secret)"
            )
        disk.check_writable(directory)
        self.directory = directory
        # The history this process saves in: a rollback recorded after it started makes its
        # newer saves part of the undone history (see unbroken.checkpoint.storage.history).
        self.history = disk.fences(directory).current
        self.keep_last = keep_last
        self.replica, self.replicas, self.rank, self.world_size = replica, replicas, rank, world_size
        self.peer = peer
        self._secret = secret
        self.owner = owner or shard_dir_name(replica, rank)
        self.rate_bytes_s = persist_rate_mb_s * 1e6 if persist_rate_mb_s else None
        self.persist_interval_s = persist_interval_s
        self._last_dispatch = -float("inf")
        self._timer: threading.Timer | None = None
        self._urgent = 0  # callers of wait(): persist now, not at the next interval
        self._layout: tuple[list[TensorSpec], list[TensorEntry]] | None = None
        self._known: dict[str, TensorSpec] = {}  # specs of the cached layout, by name
        self._cond = threading.Condition()
        self._slots: list[_Slot] = []
        self._outcomes: list[PersistOutcome] = []
        self._closing = False
        self._proc: PersistProcess | None = None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="unbroken-snapshot") if overlap else None
        self._copy: Future[None] | None = None
        self.last_stall_s = 0.0
        self._report_hooks: OrderedDict[int, ReportHook] = OrderedDict()  # RemovableHandle holds a weakref
        self.coalesced = 0  # snapshots replaced by a newer one before reaching the disk
        self.skipped_steps: deque[int | None] = deque(maxlen=256)  # the latest of them

    # ----------------------------------------------------------------- saving
    def save(self, step: int, state: Any) -> None:
        """Snapshot ``state`` (a nested dict/list of tensors and plain objects) as ``step``.

        The non-tensor objects are loaded back through the allow-list of
        :mod:`unbroken.wire.objects` (containers, numbers, strings, bytes, None, OrderedDict,
        torch.Size, dtypes, devices): a checkpoint, or a peer's copy of one, can never run code
        when loaded.

        Raises:
            ValueError: the state holds an object that would not load back (checked here, at
                once, not at the restore that would have needed it).

        Returns once the state is copied (or, with ``overlap``, once the copy is started).
        Persist failures never raise here: they are reported by :meth:`wait`.
        """
        started = time.perf_counter()
        self.fence()
        tensors, skeleton = flatten(state, known=self._known)
        objects = wire_objects.dumps(skeleton)
        try:
            wire_objects.loads(objects, own=True)  # tens of microseconds for an optimizer's hyperparameters
        except wire_objects.UnsafeObjectError as e:
            raise ValueError(f"this state cannot be checkpointed: {e}") from None
        manifest = ShardManifest(
            step,
            self.replica,
            self.replicas,
            self.rank,
            self.world_size,
            self._entries([spec for _, spec in tensors.values()]),
            extra={history.HISTORY_KEY: self.history},
        )
        with self._cond:
            slot = self._take_slot(manifest.data_len)
        if self._copier is None:
            self._snapshot(slot, manifest, objects, tensors)
        else:
            self._copy = self._copier.submit(self._snapshot, slot, manifest, objects, tensors)
        self.last_stall_s = time.perf_counter() - started
        if self._report_hooks:
            self._report(SnapshotTaken(step, self.last_stall_s, manifest.data_len))

    def register_report_hook(self, hook: ReportHook) -> RemovableHandle:
        """Calls ``hook`` with a :class:`SnapshotTaken` after each save and a
        :class:`PersistOutcome` when its write ends (on the persist thread: keep it short).

        ``unbroken.resume`` registers one that ships the figures to the coordinator, where
        ``/metrics`` exports them. Returns a handle whose ``remove()`` unregisters it.
        """
        handle = RemovableHandle(self._report_hooks)
        self._report_hooks[handle.id] = hook
        return handle

    def _report(self, report: SnapshotTaken | PersistOutcome) -> None:
        for hook in list(self._report_hooks.values()):
            try:
                hook(report)
            except Exception:  # a broken report must not fail a save
                log.exception("a checkpoint report hook failed")

    def _entries(self, specs: list[TensorSpec]) -> list[TensorEntry]:
        """The layout of these tensors: the previous save's list object when nothing changed,
        so that the buffers' cached views of it are reused."""
        if self._layout is None or self._layout[0] != specs:
            self._layout = (specs, layout(specs))
            self._known = {s.name: s for s in specs}
        return self._layout[1]

    def _take_slot(self, nbytes: int) -> _Slot:
        """A buffer to copy into: never the one being persisted; the oldest snapshot otherwise."""
        while len(self._slots) < 2:  # both at once, so no later save pays for an allocation
            self._slots.append(_Slot(HostBuffer(nbytes)))
            self._attach(len(self._slots) - 1)
        candidates = [s for s in self._slots if s.state != SlotState.INFLIGHT]
        slot = min(candidates, key=lambda s: -1 if s.step is None else s.step)
        if slot.state == SlotState.PENDING:  # the disk is still busy: the newer snapshot replaces it
            self.coalesced += 1
            self.skipped_steps.append(slot.step)
        if slot.buffer.capacity < nbytes:
            slot.buffer.close()
            slot.buffer = HostBuffer(int(nbytes * 1.25))
            self._attach(self._slots.index(slot))
        slot.state, slot.step, slot.manifest = SlotState.WRITING, None, None
        return slot

    def _attach(self, index: int) -> None:
        if self._proc is not None:
            buf = self._slots[index].buffer
            self._proc.attach(index, buf.fd, buf.capacity)

    def _snapshot(self, slot: _Slot, manifest: ShardManifest, objects: bytes, tensors: dict[str, Any]) -> None:
        copy_into(slot.buffer, manifest.tensors, tensors, single_thread=self._copier is not None)
        with self._cond:
            slot.state, slot.step, slot.manifest, slot.objects = SlotState.PENDING, manifest.step, manifest, objects
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand the newest pending snapshot to the persist process if it is idle (lock held)."""
        if self._closing or any(s.state == SlotState.INFLIGHT for s in self._slots):
            return
        pending = [s for s in self._slots if s.state == SlotState.PENDING]
        if not pending:
            return
        wait_s = self._last_dispatch + self.persist_interval_s - time.monotonic()
        if wait_s > 0 and not self._urgent:
            if self._timer is None:
                self._timer = threading.Timer(wait_s, self._on_timer)
                self._timer.daemon = True
                self._timer.start()
            return
        slot = max(pending, key=lambda s: s.step or 0)
        for older in pending:  # both buffers can wait out an interval; only the newest goes
            if older is not slot:
                older.state = SlotState.FREE
                self.coalesced += 1
                self.skipped_steps.append(older.step)
        self._last_dispatch = time.monotonic()
        if self._proc is None or not self._proc.alive():
            self._proc = PersistProcess(self._on_message)
            for i in range(len(self._slots)):
                self._attach(i)
        assert slot.manifest is not None
        self._proc.submit(
            {
                "slot": self._slots.index(slot),
                "root": self.directory,
                "keep_last": self.keep_last,
                "manifest": slot.manifest.to_json(),
                "objects": base64.b64encode(slot.objects).decode(),
                "rate_bytes_s": self.rate_bytes_s,
                "peer": list(self.peer) if self.peer else None,
                # The key crosses only the private socket pair to this process's own child.
                "peer_key": self._secret.key.hex() if self.peer and self._secret else None,
                "owner": self.owner,
            }
        )
        slot.state = SlotState.INFLIGHT

    def _on_timer(self) -> None:
        with self._cond:
            self._timer = None
            self._dispatch()

    def _on_message(self, message: dict[str, Any]) -> None:
        with self._cond:
            inflight = [s for s in self._slots if s.state == SlotState.INFLIGHT]
            if message["op"] == "done":
                slot = self._slots[message["slot"]]
                if message["ok"] and slot.manifest is not None:
                    slot.manifest.tensors = with_checksums(slot.manifest.tensors, message["crcs"])
                outcome = PersistOutcome(
                    message["step"],
                    message["ok"],
                    message.get("error"),
                    message.get("durable_s"),
                    message.get("peer_error"),
                    slot.manifest.data_len if slot.manifest is not None else 0,
                )
            elif message["op"] == "died":
                self._proc = None
                if not inflight or self._closing:
                    if not self._closing:
                        self._dispatch()
                    self._cond.notify_all()
                    return
                slot = inflight[0]
                outcome = PersistOutcome(
                    slot.step or -1,
                    False,
                    "the persist process died "
                    f"(exit code {message['returncode']}) while writing step "
                    f"{slot.step}; that step is not on disk",
                    nbytes=slot.manifest.data_len if slot.manifest is not None else 0,
                )
            else:
                return
            if not outcome.ok:
                log.warning("checkpoint: %s", outcome.error)
            self._outcomes.append(outcome)
            self._report(outcome)
            slot.state = SlotState.FREE
            self._dispatch()
            self._cond.notify_all()

    def fence(self) -> None:
        """Block until the running snapshot copy is done (call before changing the weights)."""
        if self._copy is not None:
            self._copy.result()
            self._copy = None

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for an overlapped snapshot copy before it runs."""
        optimizer.register_step_pre_hook(lambda *_: self.fence())

    def wait(self, timeout: float | None = None) -> list[PersistOutcome]:
        """Block until every snapshot taken so far is durable (or failed); return the outcomes
        since the last ``wait``. Failures are reported here, not raised: training goes on."""
        self.fence()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._urgent += 1
            try:
                self._dispatch()
                while any(s.state in (SlotState.PENDING, SlotState.INFLIGHT) for s in self._slots):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("checkpoints still being persisted")
                    self._cond.wait(left)
            finally:
                self._urgent -= 1
            outcomes, self._outcomes = self._outcomes, []
        return outcomes

    @property
    def persist_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Finish pending writes, stop the persist process, free the buffers."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closing = True
                proc, self._proc = self._proc, None
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            if proc is not None:
                proc.close()
            if self._copier is not None:
                self._copier.shutdown()
            for s in self._slots:
                s.buffer.close()
            self._slots.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- loading
    def load_latest(self, into: Any = None, at_most: int | None = None) -> Restored:
        """Restore the newest good checkpoint: memory, then peer memory, then disk.

        A candidate that fails to load for any reason (damaged data, a bad manifest, a state
        that does not fit) is skipped, with the reason in :attr:`Restored.skipped`, and the
        next older one is tried: one bad checkpoint never hides an intact older one.

        Args:
            into: optionally, a state of the same structure whose tensors are filled in place
                (no allocation; also how a rank of a differently sized job asks for its shards,
                by holding :class:`Shard` markers with its own offsets).
            at_most: only consider steps up to this one (a rollback's target, whose fall-back
                must be older, never a step of the history the rollback undid).
        """
        return self._restore(None, into, at_most)

    def load(self, step: int, into: Any = None) -> Restored:
        """Restore one particular step (see :meth:`load_latest`)."""
        return self._restore(step, into)

    def _restore(self, step: int | None, into: Any, at_most: int | None = None) -> Restored:
        self.fence()
        try:
            fences = disk.fences(self.directory)
        except disk.CorruptCheckpoint as exc:
            raise CheckpointError(f"could not restore from {self.directory}: {exc}") from exc
        want = flatten(into)[0] if into is not None else None
        candidates: list[tuple[int, int, Tier, Any]] = []
        with self._cond:
            for s in self._slots:
                if s.state != SlotState.WRITING and s.manifest is not None and self._fits(s.manifest, want):
                    candidates.append((s.manifest.step, 0, Tier.MEMORY, s))
        if self.peer is not None:
            try:
                assert self._secret is not None
                copy = PeerClient(*self.peer, self._secret).get(self.owner)
                if copy is not None and self._fits(copy.manifest, want):
                    candidates.append((copy.manifest.step, 1, Tier.PEER, copy))
            except OSError as exc:
                log.warning("checkpoint: peer %s unreachable (%s)", self.peer, exc)
        candidates += [(s, 2, Tier.DISK, None) for s in disk.complete_steps(self.directory)]
        candidates = sorted(
            (c for c in candidates if (step is None or c[0] == step) and (at_most is None or c[0] <= at_most)),
            key=lambda c: (-c[0], c[1]),
        )
        skipped: list[str] = []
        for cstep, _, source, handle in candidates:
            try:
                if source != Tier.DISK:  # the disk's shards are sorted by history in disk.step_readers
                    manifest = handle.manifest
                    why = fences.undone(manifest.step, history.history_of(manifest.extra))
                    if why:
                        raise disk.CorruptCheckpoint(why)
                if source == Tier.MEMORY:
                    return self._from_memory(handle, want, skipped)
                if source == Tier.PEER:
                    handle.verify()
                    return self._from_bytes(
                        handle.manifest, handle.objects, memoryview(handle.data), want, Tier.PEER, skipped
                    )
                return self._from_disk(cstep, want, skipped, fences)
            except Exception as exc:  # noqa: BLE001 - whatever broke this candidate, try the next
                reason = f"step {cstep} from {source}: {exc}"
                log.warning("checkpoint: skipping %s", reason)
                skipped.append(reason)
        what = (
            f"step {step}"
            if step is not None
            else "any checkpoint"
            if at_most is None
            else f"any checkpoint up to step {at_most}"
        )
        raise CheckpointError(
            f"could not restore {what} from {self.directory}"
            + (f"; tried: {'; '.join(skipped)}" if skipped else "; none found")
        )

    def _fits(self, manifest: ShardManifest, want: dict[str, Any] | None) -> bool:
        """Whether a memory/peer copy of our own shard serves this request without re-cutting."""
        if manifest.world_size != self.world_size or manifest.rank != self.rank:
            return False
        if want is None:
            return True
        have = {t.name: t for t in manifest.tensors}
        return all(
            n in have
            and have[n].shape == spec.shape
            and have[n].global_offset == spec.global_offset
            and have[n].dtype == spec.dtype
            for n, (_, spec) in want.items()
        )

    def _from_memory(self, slot: _Slot, want: dict[str, Any] | None, skipped: list[str]) -> Restored:
        assert slot.manifest is not None
        tensors, pairs = {}, []
        for e in slot.manifest.tensors:
            src = slot.buffer.view(e)
            if want and e.name in want:
                tensors[e.name] = want[e.name][0]
                pairs.append((want[e.name][0], src))
            else:
                tensors[e.name] = src.clone()
        copy_all(pairs)
        state = unflatten(
            wire_objects.loads(slot.objects, own=True), tensors, {e.name: e for e in slot.manifest.tensors}
        )
        return Restored(slot.manifest.step, state, Tier.MEMORY, skipped, slot.manifest.world_size)

    def _from_bytes(
        self,
        manifest: ShardManifest,
        objects: bytes,
        data: memoryview,
        want: dict[str, Any] | None,
        source: Tier,
        skipped: list[str],
    ) -> Restored:
        tensors = {}
        for e in manifest.tensors:
            src = (
                torch.frombuffer(data[e.begin : e.end], dtype=torch.uint8)
                if e.end > e.begin
                else torch.empty(0, dtype=torch.uint8)
            )
            src = src.view(getattr(torch, e.dtype)).view(e.shape)
            tensors[e.name] = want[e.name][0].copy_(src) if want and e.name in want else src.clone()
        state = unflatten(wire_objects.loads(objects), tensors, {e.name: e for e in manifest.tensors})
        return Restored(manifest.step, state, source, skipped, manifest.world_size)

    def _from_disk(
        self, step: int, want: dict[str, Any] | None, skipped: list[str], fences: history.Fences | None = None
    ) -> Restored:
        shards = restore.open_step(self.directory, step, fences)
        source_rank = reshard.objects_source_rank(self.rank, shards.world_size)
        skeleton = wire_objects.loads(shards.objects(source_rank))
        if want is None:
            if shards.world_size != self.world_size:
                raise ValueError(
                    f"saved by {shards.world_size} ranks, loading at {self.world_size}: "
                    "pass into= with this rank's Shard markers to re-cut the tensors"
                )
            want = {
                e.name: (torch.empty(e.shape, dtype=getattr(torch, e.dtype)), e)
                for e in shards.manifests[source_rank].tensors
            }
        tensors = shards.read(want)
        state = unflatten(skeleton, tensors, {n: spec for n, (_, spec) in want.items()})
        return Restored(step, state, Tier.DISK, skipped, shards.world_size)


__all__ = ["Checkpointer", "CheckpointError", "PersistOutcome", "Restored", "Shard", "Tier"]
