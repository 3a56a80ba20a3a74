"""The job's checkpoints, from a training loop: when to save and where to start from.

Replicas hold the same state, so one of them saves each checkpoint
(:attr:`~unbroken.train.manager.Manager.writes_checkpoints`). Where a process starts:

- the step the supervisor rolled the job back to (``UNBROKEN_RESUME_STEP``): every replica must
  start from the same state, and a newer checkpoint may hold the damage the rollback undoes. The
  supervisor checked that it loads; should it fail here all the same, the next older good
  checkpoint is loaded (never a newer one, never step 0 while an older one loads);
- else, for every process, first or restarted, the newest good checkpoint. A restarted process
  does not know whether a live peer is ahead of it: when every replica died at once (a
  job-wide failure) there is none, and starting at step 0 would throw the run away and then
  overwrite its checkpoints. So it loads the newest checkpoint, and if a peer is ahead after
  all, the quorum marks it behind and it catches up from that peer, as any replica behind does
  (a loaded checkpoint is never newer than a live peer: it was saved by one). The price is one
  read of the checkpoint per restart, off the survivors' path;
- else (no checkpoint) step 0, or a peer's state through catch-up.

A directory that holds the job's checkpoints (a complete step, a ``latest`` pointer, a
rollback's record) of which none loads stops the process with :class:`CheckpointError`, first
start or restart: step 0 there would throw the run away. After a rollback no tier (memory, a
peer's copy, a disk step whose delete failed) offers a step of the history it undid
(:mod:`unbroken.checkpoint.storage.history`).

On SIGTERM, :func:`save_if_due` flushes the state and exits (see
:mod:`unbroken.train.preemption`).

A loop needs two calls::

    ck = unbroken.Checkpointer(manager.config.checkpoint_dir, ...)
    unbroken.resume(manager, ck)
    while ...:
        ...; optimizer.step()
        if manager.last_step_committed:
            unbroken.save_if_due(manager, ck, every=10)
"""

from __future__ import annotations

import logging

from unbroken.checkpoint import Checkpointer, CheckpointError, Restored
from unbroken.checkpoint.checkpointer import PersistOutcome, SnapshotTaken
from unbroken.checkpoint.storage import disk
from unbroken.checkpoint.storage.disk import complete_steps
from unbroken.diagnosis.telemetry import CheckpointPersisted, CheckpointSaved
from unbroken.train import preemption
from unbroken.train.manager import Manager

log = logging.getLogger(__name__)


def checkpointer_for(manager: Manager, keep_last: int = 3, **kwargs: object) -> Checkpointer | None:
    """This rank's :class:`Checkpointer` in the job's checkpoint directory (None without one)."""
    c = manager.config
    if not c.checkpoint_dir:
        return None
    if kwargs.get("peer"):
        kwargs.setdefault("secret", manager.secret)  # a peer tier demands the job's key
    return Checkpointer(
        c.checkpoint_dir,
        keep_last,
        replica=c.replica_id,
        replicas=max(c.num_replicas, c.replica_id + 1),
        rank=c.rank,
        world_size=c.world_size,
        **kwargs,
    )


def expects_checkpoint(directory: str) -> bool:
    """Whether a process of this job must load a checkpoint from ``directory``: it holds a
    complete step, a ``latest`` pointer (a step was saved) or a rollback's record."""
    return (
        bool(complete_steps(directory))
        or disk.read_latest(directory) is not None
        or bool(disk.fences(directory).fences)
    )


def resume(manager: Manager, checkpointer: Checkpointer | None) -> Restored | None:
    """Loads the checkpoint this process starts from, if any (see the module doc), and has the
    checkpointer's costs (stall, write time, bytes) reported to the coordinator's ``/metrics``."""
    if checkpointer is None:
        if manager.config.resume_step is not None:
            raise ValueError(
                "the supervisor rolled the job back to step "
                f"{manager.config.resume_step}, but this loop has no Checkpointer to load it"
            )
        return None
    preemption.install()
    _report_costs(manager, checkpointer)
    step = manager.config.resume_step
    if step is not None:
        restored = checkpointer.load_latest(at_most=step)
        if restored.step != step:
            log.warning(
                "replica %d: the rollback's checkpoint of step %d did not load (%s); resuming from " "step %d",
                manager.config.replica_id,
                step,
                "; ".join(restored.skipped),
                restored.step,
            )
    elif expects_checkpoint(checkpointer.directory):
        try:
            restored = checkpointer.load_latest()
        except CheckpointError as exc:
            # Never step 0 while the job has saved: when every replica restarts at once, none
            # would be ahead to catch up from, the job would train from scratch and retention
            # would delete each new save beside the newer ones that do not load.
            raise CheckpointError(
                f"replica {manager.config.replica_id}: {checkpointer.directory} holds this job's "
                f"checkpoints but none loads, so this process will not start over from step 0 ({exc}). "
                "Repair or move the damaged steps, or give the job a new --checkpoint-dir to start afresh."
            ) from exc
    else:
        return None
    manager.load_state_dict(restored.state)
    log.info(
        "replica %d resumes at step %d from the %s checkpoint", manager.config.replica_id, manager.step, restored.source
    )
    return restored


def _report_costs(manager: Manager, checkpointer: Checkpointer) -> None:
    """Ships each save's stall and each write's time and bytes to the coordinator with the
    rank's telemetry; it writes them to the event log, where ``/metrics`` finds them."""
    recorder = manager.recorder
    if recorder is None:
        return

    def report(r: SnapshotTaken | PersistOutcome) -> None:
        if isinstance(r, SnapshotTaken):
            recorder.note(CheckpointSaved(r.step, r.stall_s, r.nbytes))
        elif r.step >= 0:
            recorder.note(CheckpointPersisted(r.step, r.ok, r.durable_s or 0.0, r.nbytes))

    checkpointer.register_report_hook(report)


def save_if_due(manager: Manager, checkpointer: Checkpointer | None, every: int) -> bool:
    """After a committed step: snapshots the state if this replica writes checkpoints and
    ``every`` steps have passed. The save returns once the state is copied.

    After SIGTERM (with a checkpointer, set up by :func:`resume`) this does not return: every
    replica saves this step, waits until it is on disk and exits with
    :data:`~unbroken.train.preemption.EXIT_PREEMPTED`.
    """
    if checkpointer is None:
        return False
    if preemption.requested() and preemption.should_stop(manager.step, manager.config.world_size):
        flush_and_exit(manager, checkpointer)
    if every <= 0 or manager.step % every or not manager.writes_checkpoints:
        return False
    checkpointer.save(manager.step, manager.state_dict())
    return True


def flush_and_exit(manager: Manager, checkpointer: Checkpointer) -> None:
    """Saves this step, waits for the disk, ends the process (:mod:`unbroken.train.preemption`)."""
    c = manager.config
    log.warning("replica %d rank %d: SIGTERM: saving step %d and exiting", c.replica_id, c.rank, manager.step)
    code = preemption.EXIT_PREEMPTED
    try:
        checkpointer.save(manager.step, manager.state_dict())
        outcomes = checkpointer.wait()
        checkpointer.close()
        for o in outcomes:
            if not o.ok:
                log.error("replica %d: the flush of step %d failed: %s", c.replica_id, o.step, o.error)
        if not any(o.ok and o.step == manager.step for o in outcomes):
            code = preemption.EXIT_FLUSH_FAILED
    except Exception:  # noqa: BLE001 - exit anyway: the grace period is running
        log.exception("replica %d: the flush on SIGTERM failed", c.replica_id)
        code = preemption.EXIT_FLUSH_FAILED
    preemption.exit_now(code)
