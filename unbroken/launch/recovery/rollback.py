"""Rolling every replica of ``unbroken run`` back to a checkpoint: deciding, recording, doing.

A ``metric_anomaly`` verdict whose policy asks for ``rollback`` (:mod:`unbroken.launch.recovery.verdicts`)
acts on the whole job: by the time a spike is judged its gradient is in every replica. Kept out
of the supervisor's loop because it is a small protocol of its own, with its own state: the
target is verified before anything stops (a thread reads every checksum), the undone history is
recorded before any process stops (so no tier offers a step of it), every live replica is
restarted onto the target, and the newer checkpoints are deleted once every old process is gone
and before any new one starts. A second verdict while one rollback is chosen or under way is
refused with a ``verdict_ignored`` event.

The supervisor hands in what a rollback touches (its replicas, their lifecycle, how to fail a
replica, how to run a task) and asks :meth:`Rollback.ready` before it starts a replica that
resumes from the target.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from unbroken.checkpoint.storage.disk import CorruptCheckpoint, newest_verified_step
from unbroken.checkpoint.storage.history import record_rollback
from unbroken.checkpoint.storage.retention import discard_newer
from unbroken.launch.lifecycle import RUNNING, Lifecycle, State
from unbroken.launch.recovery.verdicts import ROLLBACK, anomaly, anomaly_step, culprit_replica
from unbroken.launch.workers import SupervisedReplica
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog

_LEFT_ALONE = (State.FINISHED, State.STOPPED, State.ISOLATED)  # nothing of theirs to roll back


class Rollback:
    """Rolls the job back on a verdict; one rollback at a time.

    Args:
        checkpoint_dir: the job's checkpoints (``--checkpoint-dir``); None refuses every rollback.
        events: the supervisor's event log.
        replicas: the supervisor's replicas, by id (their ``resume_step`` is set here).
        lifecycle: their states (read only: a rollback moves them through ``fail``).
        fail: fails a running replica with the given reason, without blame, so that the
            supervisor's restart path starts it again (from its ``resume_step``).
        stopped: whether the job is ending (a rollback chosen by then does nothing).
        run_task: runs a coroutine as one of the supervisor's tasks (cancelled at its end).
    """

    def __init__(
        self,
        checkpoint_dir: Path | None,
        events: EventLog,
        replicas: Mapping[int, SupervisedReplica],
        lifecycle: Lifecycle,
        fail: Callable[[SupervisedReplica, str], None],
        stopped: Callable[[], bool],
        run_task: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.events = events
        self.replicas = replicas
        self.lifecycle = lifecycle
        self.fail = fail
        self.stopped = stopped
        self.run_task = run_task
        self.rolling_back: set[int] = set()  # replicas restarted by the last rollback
        self.choosing = False  # a rollback's target is being verified
        self.discard: asyncio.Task[None] | None = None  # the last rollback's discard of newer steps

    async def ready(self) -> None:
        """Returns once the last rollback's newer checkpoints are gone: no process that resumes
        from the target starts before (it would find them)."""
        if self.discard is not None:
            await asyncio.shield(self.discard)

    def start(self, verdict: ev.Verdict, why: str) -> None:
        """Restarts every replica from the newest checkpoint before the anomalous step that loads.

        The target is verified (manifests and every checksum, in a thread: it reads the whole
        checkpoint) before anything is stopped or deleted; a damaged one gives way to the next
        older one. The checkpoints newer than the target are deleted once, by
        :meth:`_discard_after`, when every old process is gone and before any new one starts.
        """
        step = anomaly_step(verdict)

        def ignore(reason: str) -> None:
            self._ignore(verdict, reason)

        if self.choosing or (
            self.rolling_back and any(self.lifecycle.state[r] != State.TRAINING for r in self.rolling_back)
        ):
            return ignore("a rollback is under way")
        self.rolling_back = set()
        if self.checkpoint_dir is None:
            return ignore("no checkpoint directory to roll back to (unbroken run --checkpoint-dir)")
        if step is None:
            return ignore("the verdict names no step")
        self.choosing = True
        self.run_task(self._roll_back_to_verified(verdict, why, step))

    def _ignore(self, verdict: ev.Verdict, reason: str) -> None:
        self.events.emit(
            "verdict_ignored",
            verdict_class=verdict.verdict_class,
            replica=culprit_replica(verdict),
            action=ROLLBACK,
            reason=reason,
        )

    async def _roll_back_to_verified(self, verdict: ev.Verdict, why: str, step: int) -> None:
        assert self.checkpoint_dir is not None
        root = str(self.checkpoint_dir)
        try:
            target, skipped = await asyncio.to_thread(newest_verified_step, root, step)
        finally:
            self.choosing = False
        if target is None:
            return self._ignore(
                verdict,
                f"no loadable checkpoint at or before step {step} in {root}"
                + (f" ({'; '.join(skipped)})" if skipped else ""),
            )
        if self.stopped():
            return
        try:
            # Before any process stops: from here no tier offers a step of the undone history.
            await asyncio.to_thread(record_rollback, root, target)
        except (OSError, ValueError) as exc:
            return self._ignore(verdict, f"cannot record the rollback to step {target} in {root}: {exc}")
        replica = culprit_replica(verdict)
        self.events.emit(
            "verdict_acted", verdict_class=verdict.verdict_class, replica=replica, action=ROLLBACK, reason=why
        )
        self.events.emit(
            "rollback", step=target, anomaly_step=step, culprit=replica, anomaly=anomaly(verdict), skipped=skipped
        )
        old: list[asyncio.subprocess.Process] = []
        for r in self.replicas.values():
            if self.lifecycle.state[r.replica] in _LEFT_ALONE:
                continue
            r.resume_step = target
            self.rolling_back.add(r.replica)
            old += r.procs
            if self.lifecycle.state[r.replica] in RUNNING and r.procs:
                self.fail(r, f"rollback to the checkpoint of step {target} ({why})")
        self.discard = asyncio.create_task(self._discard_after(old, root, target))

    async def _discard_after(self, old: list[asyncio.subprocess.Process], root: str, target: int) -> None:
        """Once every old process has ended (none can still be persisting a newer step), deletes
        the checkpoints after ``target``: they hold the history the rollback undid."""
        await asyncio.gather(*(p.wait() for p in old))
        try:
            discarded = await asyncio.to_thread(discard_newer, root, target)
        except (CorruptCheckpoint, OSError, ValueError) as exc:
            # The target broke since it was verified: keep everything; the workers fall back to
            # the next older checkpoint that loads (resume(): never a newer one).
            self.events.emit("checkpoints_kept", rollback_step=target, reason=str(exc))
            return
        if discarded:
            self.events.emit("checkpoints_discarded", steps=discarded, rollback_step=target)
