"""Which old checkpoints to delete: ``keep_last`` complete ones survive, and nothing newer.

The rule is deliberately conservative because deleting the only good checkpoint is the classic
way to lose a run: only steps strictly older than the oldest kept complete step are removed,
so the newest complete checkpoint and anything still being written (newer, incomplete) stay.
"""

from __future__ import annotations

import os
import shutil

from unbroken.checkpoint import disk
from unbroken.checkpoint.manifest import step_dir_name


def plan(all_steps: list[int], complete: list[int], keep_last: int) -> list[int]:
    """Steps to delete, given every step directory and the complete ones.

    Args:
        all_steps: every step directory present, complete or not.
        complete: the steps whose every rank committed its shard.
        keep_last: how many complete steps to keep (at least 1).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest checkpoint is never deleted")
    kept = sorted(complete, reverse=True)[:keep_last]
    if not kept:
        return []
    oldest_kept = min(kept)
    return sorted(s for s in all_steps if s < oldest_kept)


def apply(root: str, keep_last: int) -> list[int]:
    """Delete what :func:`plan` says, oldest first; returns the deleted steps."""
    doomed = plan(disk.list_steps(root), disk.complete_steps(root), keep_last)
    for step in doomed:
        path = os.path.join(root, step_dir_name(step))
        # Rename first so a crash mid-delete leaves no half-deleted step that looks real.
        trash = os.path.join(root, f".trash-{step_dir_name(step)}-{os.getpid()}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def discard_newer(root: str, step: int) -> list[int]:
    """Delete every checkpoint newer than ``step`` and point ``latest`` at ``step``.

    After a rollback to ``step`` they belong to an abandoned history (the one the rollback
    undid); left in place, a later resume or rollback could load the damage again, and a
    replayed step saved by another replica would sit beside its stale shards.
    """
    doomed = [s for s in disk.list_steps(root) if s > step]
    for s in doomed:
        trash = os.path.join(root, f".trash-{step_dir_name(s)}-{os.getpid()}")
        os.rename(os.path.join(root, step_dir_name(s)), trash)
        shutil.rmtree(trash, ignore_errors=True)
    disk.update_latest(root, step)
    return sorted(doomed)
