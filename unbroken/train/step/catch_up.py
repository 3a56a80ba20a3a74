"""A replica's side of live catch-up: fetching a donor's state, donating its own, applying it.

A replica that is behind (a restarted process) downloads the state of the step its quorum trains
from a donor while the survivors compute, and enters that step's exchange with zeros early so
that nobody waits for its first forward pass; a donor snapshots its state for the newcomer before
the optimizer moves it. :class:`~unbroken.train.manager.Manager` drives the step; this module
holds what the catch-up keeps between the calls of a step, and the threads it runs on
(docs/architecture.md, "Threads of a replica process").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from unbroken.comm.catchup import CatchupServer, SnapshotCopy, fetch_state, snapshot_layout
from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.comm.recorder import FlightRecorder
from unbroken.control.quorum.rules import QuorumDecision
from unbroken.diagnosis.telemetry import CaughtUp
from unbroken.train.step.overlap import METADATA
from unbroken.wire.auth import JobSecret

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Fetched:
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


class DonateHint:
    """The coordinator's forecast that this replica serves a newcomer at its next step.

    Set on the connection thread (the client's ``on_donate``), taken on the training thread; a
    hint that comes too late for a step is spent on that step.
    """

    def __init__(self, replica_id: int) -> None:
        self.replica_id = replica_id
        self._event = threading.Event()

    def __call__(self, newcomer: int) -> None:
        log.info("replica %d will likely serve replica %d at its next step", self.replica_id, newcomer)
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event.clear()


class CatchUp:
    """What one replica's catch-up keeps between calls: its download, its donation, its early exchange.

    The download and the early exchange are started by whichever thread acts on a quorum answer
    first (the Manager orders that under its lock); everything else runs on the training thread.
    ``stats`` is the Manager's, where the figures of each recovery and donation are written.
    """

    def __init__(
        self,
        server: CatchupServer,
        secret: JobSecret,
        replica_id: int,
        stats: dict[str, float],
        recorder: FlightRecorder | None = None,
        hint: DonateHint | None = None,
        fetch: Callable[..., Any] = fetch_state,
    ) -> None:
        self.server = server
        self._fetch_state = fetch  # the download: fetch_state(address, step, secret, into=...)
        self.hint = hint or DonateHint(replica_id)
        self.secret = secret
        self.replica_id = replica_id
        self.stats = stats
        self.recorder = recorder
        self.own_state: dict[str, Any] | None = None  # a fresh process's tensors, to fetch into
        self.prepared_for: tuple[int, int] | None = None  # the (epoch, step) a catch-up started for
        self._fetch: tuple[float, Future[Fetched]] | None = None  # started at, the download
        # The donor and step of the newest catch-up decision, when a fetch for an older step was
        # already running: that fetch is finished first, then this one is made (see finish).
        self._refetch: tuple[str, int] | None = None
        self._snapshot: SnapshotCopy | None = None  # a donation still being copied
        self._early: tuple[int, Future[tuple[float, torch.Tensor]]] | None = None  # epoch, (seconds, sum)
        self._prewarmed = False

    # -- the replica that is behind --------------------------------------------------------

    def note_own_state(self, state: Callable[[], dict[str, Any]]) -> None:
        """Notes where this process's tensors live, so that a fetch writes the donor's bytes
        straight into them: called on the training thread by a process that has not trained
        yet, most likely a restarted one about to catch up."""
        if self.own_state is None:
            with contextlib.suppress(Exception):
                self.own_state = state()

    @property
    def fetching(self) -> bool:
        """A download is running or not yet applied (it may still write into our tensors)."""
        return self._fetch is not None

    def plan(self, d: QuorumDecision, transfer_addrs: dict[str, str]) -> bool:
        """Starts this replica's download for decision ``d`` if it is behind; True the first time
        per decision (a second exchange of that decision would pair with the peers' next one)."""
        if self.replica_id not in d.behind or self.prepared_for == (d.epoch, d.step):
            return False
        self.prepared_for = (d.epoch, d.step)
        address = transfer_addrs[str(d.donor_of(self.replica_id))]
        if self._fetch is None:
            self.start_fetch(address, d.step)
            self._refetch = None
        else:  # a fetch of an earlier decision runs on (it may be for this very step)
            self._refetch = (address, d.step)
        return True

    def start_fetch(self, address: str, step: int) -> None:
        """Starts downloading the donor's state of ``step`` (runs on the connection thread
        when prepared early); the training thread waits for it in :meth:`finish`."""
        into, self.own_state = self.own_state, None

        def run() -> Fetched:
            cpu = time.thread_time()
            state = self._fetch_state(address, step, self.secret, into=into)
            return Fetched(state, time.perf_counter(), time.thread_time() - cpu)

        self._fetch = (time.perf_counter(), in_background("unbroken-fetch", run))

    def fetched(self) -> bool:
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
            log.warning("replica %d: catch-up from a donor failed (%s); fetching again", self.replica_id, e)
            self.stats["catch_up_failures"] = self.stats.get("catch_up_failures", 0) + 1
            self._fetch = self._refetch = None
            self.prepared_for = None
            return False
        return True

    def finish(self, decision: QuorumDecision, load: Callable[[dict[str, Any]], int]) -> int:
        """Applies the downloaded state with ``load`` (which returns its step) and records the
        recovery's figures; returns the step the replica is now at."""
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
                state = self._fetch_state(refetch[0], decision.step, self.secret)
            except Exception as e:
                raise RuntimeError(f"catch-up from a donor failed: {e}") from e
            fetched = Fetched(state, time.perf_counter(), fetched.cpu_s)
        state = fetched.state
        loading = time.perf_counter()
        step = load(state)
        self.stats["recoveries"] = self.stats.get("recoveries", 0) + 1
        now = time.perf_counter()
        self.stats["last_recovery_s"] = now - started
        self.stats["last_fetch_s"] = fetched.done_at - started
        self.stats["last_load_s"] = now - loading
        self.stats["last_fetch_cpu_s"] = fetched.cpu_s
        if self.recorder is not None:
            self.recorder.note(CaughtUp(step, now - started, snapshot_layout(state)[3]))
        log.info(
            "replica %d caught up to step %d: fetch %.3fs, load %.3fs",
            self.replica_id,
            step,
            self.stats["last_fetch_s"],
            self.stats["last_load_s"],
        )
        return step

    def start_early_exchange(
        self, group: CrossReplicaGroup, d: QuorumDecision, numel: int, deadline_s: float, device: torch.device
    ) -> None:
        """Enters a catching-up replica's zero-gradient exchange now, on a background thread.

        Its gradient for this step is thrown away, so there is nothing to wait for: the
        survivors then find it already in the exchange instead of waiting for a forward and
        backward pass of a process that has just started (the slowest of the step).
        """

        def run() -> tuple[float, torch.Tensor]:
            buf = torch.zeros(numel + METADATA, dtype=torch.float32, device=device)
            buf[numel + 1] = float(d.step)
            return group.allreduce_sum(buf, deadline_s), buf

        self._early = (d.epoch, in_background("unbroken-catch-up-exchange", run))

    def take_early_exchange(self, epoch: int) -> Future[tuple[float, torch.Tensor]] | None:
        """The early exchange begun for ``epoch``, if any (an older one is dropped)."""
        early, self._early = self._early, None
        return early[1] if early is not None and early[0] == epoch else None

    # -- the donor ---------------------------------------------------------------------------

    def donate_if_hinted(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At a step start: told that a newcomer will be admitted at this step with this replica
        as its donor, snapshot now, so that the peer's fetch overlaps this step's compute."""
        if self.hint.is_set() and self._snapshot is None:
            self.hint.clear()
            self.take_snapshot(step, state(), early=True)

    def donate(self, d: QuorumDecision, step: int, state: Callable[[], dict[str, Any]]) -> bool:
        """Whether this replica serves a peer under ``d``; snapshots ``step`` then, unless the
        coordinator's hint came in time for it."""
        if not any(donor == self.replica_id for (_, donor) in d.donors):
            return False
        self.hint.clear()  # a hint that came too late for this step is spent on it
        if self._snapshot is None or self._snapshot.snapshot.step != d.step:
            self.take_snapshot(step, state(), early=False)
        self.stats["donations"] += 1
        return True

    def take_snapshot(self, step: int, state: dict[str, Any], early: bool) -> None:
        """Snapshots the state of ``step`` for a peer, before the optimizer moves it.

        Taken on the training thread; the bulk (large host tensors) is copied on a background
        thread beside the step's compute and exchange, which read those tensors but do not
        change them, and the snapshot is served once complete. The Manager waits for the copy
        (:meth:`settle`) before the optimizer steps.
        """
        taken = time.perf_counter()
        self._snapshot = SnapshotCopy(step, state, self.server.pool, self.server.publish)
        self.stats["last_snapshot_s"] = time.perf_counter() - taken
        self.stats["last_snapshot_early"] = float(early)

    def settle(self) -> None:
        """Waits until a donated snapshot is fully copied: the caller's optimizer steps next."""
        if self._snapshot is not None:
            waited = time.perf_counter()
            self._snapshot.wait()
            self._snapshot = None
            self.stats["last_snapshot_wait_s"] = time.perf_counter() - waited

    def prewarm(self, state: Callable[[], dict[str, Any]]) -> None:
        """Reserves the snapshot pool's memory once, after the first commit: the state is complete
        (optimizer state exists) only then."""
        if not self._prewarmed:
            self._prewarmed = True
            self.server.pool.prewarm(snapshot_layout(state())[3])
