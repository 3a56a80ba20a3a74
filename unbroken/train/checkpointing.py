"""The job's checkpoints, from a training loop: when to save and where to start from.

Replicas hold the same state, so one of them saves each checkpoint
(:attr:`~unbroken.train.manager.Manager.writes_checkpoints`). Where a process starts:

- the step the supervisor rolled the job back to (``UNBROKEN_RESUME_STEP``), exactly that one:
  every replica must start from the same state, and a newer checkpoint may hold the damage
  the rollback undoes;
- else, for the job's first processes, the newest good checkpoint: a relaunched job continues
  where it stopped;
- else nothing: a replica restarted while the job runs catches up from a peer, whose state is
  newer than any checkpoint.

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

from unbroken.checkpoint import Checkpointer, Restored
from unbroken.checkpoint.disk import complete_steps
from unbroken.train.manager import Manager

log = logging.getLogger(__name__)


def checkpointer_for(manager: Manager, keep_last: int = 3, **kwargs: object) -> Checkpointer | None:
    """This rank's :class:`Checkpointer` in the job's checkpoint directory (None without one)."""
    c = manager.config
    if not c.checkpoint_dir:
        return None
    return Checkpointer(c.checkpoint_dir, keep_last, replica=c.replica_id,
                        replicas=max(c.num_replicas, c.replica_id + 1), rank=c.rank,
                        world_size=c.world_size, **kwargs)  # type: ignore[arg-type]


def resume(manager: Manager, checkpointer: Checkpointer | None) -> Restored | None:
    """Loads the checkpoint this process starts from, if any (see the module doc)."""
    if checkpointer is None:
        if manager.config.resume_step is not None:
            raise ValueError("the supervisor rolled the job back to step "
                             f"{manager.config.resume_step}, but this loop has no Checkpointer to load it")
        return None
    step = manager.config.resume_step
    if step is not None:
        restored = checkpointer.load(step)
    elif manager.config.restart_count == 0 and complete_steps(checkpointer.directory):
        restored = checkpointer.load_latest()
    else:
        return None
    manager.load_state_dict(restored.state)
    log.info("replica %d resumes at step %d from the %s checkpoint", manager.config.replica_id,
             manager.step, restored.source)
    return restored


def save_if_due(manager: Manager, checkpointer: Checkpointer | None, every: int) -> bool:
    """After a committed step: snapshots the state if this replica writes checkpoints and
    ``every`` steps have passed. The save returns once the state is copied."""
    if checkpointer is None or every <= 0 or manager.step % every or not manager.writes_checkpoints:
        return False
    checkpointer.save(manager.step, manager.state_dict())
    return True
