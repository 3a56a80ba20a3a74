"""Which old checkpoints to delete: ``keep_last`` verified ones survive, and nothing newer.

The rule is deliberately conservative because deleting the only good checkpoint is the classic
way to lose a run:

- only checkpoints whose every checksum was read back and matched count towards ``keep_last``
  (:func:`unbroken.checkpoint.storage.disk.verify_step`; each step is read once, the first time it
  counts): with ``keep_last=1``, a newest checkpoint with one flipped byte must not be the
  reason the intact one before it goes;
- only steps strictly older than the oldest of the ``keep_last`` newest verified steps are
  removed, and nothing at all while fewer than ``keep_last`` verified steps exist: the newest
  verified checkpoint, anything newer (being written, or damaged and kept for inspection) and
  anything a job resumed from stay.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from unbroken.checkpoint.storage import disk
from unbroken.checkpoint.storage.manifest import step_dir_name


def plan(all_steps: list[int], verified: list[int], keep_last: int) -> list[int]:
    """Steps to delete, given every step directory and the verified complete ones.

    Args:
        all_steps: every step directory present, complete or not.
        verified: complete steps known to load; need only hold the newest ``keep_last`` of them.
        keep_last: how many verified steps to keep (at least 1).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest checkpoint is never deleted")
    kept = sorted(verified, reverse=True)[:keep_last]
    if len(kept) < keep_last:
        return []
    oldest_kept = min(kept)
    return sorted(s for s in all_steps if s < oldest_kept)


def newest_verified(
    root: str,
    keep_last: int,
    candidates: list[int] | None = None,
    verify: Callable[[str, int], object] = disk.verify_step,
) -> list[int]:
    """Up to ``keep_last`` of the newest ``candidates`` (default: the complete steps) that
    ``verify(root, step)`` accepts without raising, newest first."""
    found: list[int] = []
    for step in disk.complete_steps(root) if candidates is None else candidates:
        try:
            verify(root, step)
        except (disk.CorruptCheckpoint, OSError, ValueError):
            continue
        found.append(step)
        if len(found) == keep_last:
            break
    return found


def apply(
    root: str,
    keep_last: int,
    verify: Callable[[str, int], object] | None = None,
) -> list[int]:
    """Delete what :func:`plan` says, oldest first; returns the deleted steps.

    ``verify``: how a step is checked (default: the Checkpointer's manifests and checksums,
    among complete steps); another layout (DCP's) passes its own and every step directory is
    a candidate.
    """
    all_steps = disk.list_steps(root)
    if len(all_steps) <= keep_last:
        return []  # nothing to delete: spare the reading
    if verify is None:
        good = newest_verified(root, keep_last)
    else:
        good = newest_verified(root, keep_last, candidates=all_steps, verify=verify)
    doomed = plan(all_steps, good, keep_last)
    return [s for s in doomed if remove_step(root, s)]


def remove_step(root: str, step: int) -> bool:
    """Delete one step directory; False if another process got there first."""
    # Rename first so a crash mid-delete leaves no half-deleted step that looks real.
    trash = os.path.join(root, f".trash-{step_dir_name(step)}-{os.getpid()}")
    try:
        os.rename(os.path.join(root, step_dir_name(step)), trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def discard_newer(root: str, step: int) -> list[int]:
    """Roll the directory back to ``step``: check that it loads, delete every newer checkpoint
    and point ``latest`` at ``step``.

    After a rollback to ``step`` they belong to an abandoned history (the one the rollback
    undid); left in place, a later resume or rollback could load the damage again, and a
    replayed step saved by another replica would sit beside its stale shards. The target is
    verified first (manifests and every checksum): if it does not load, nothing is deleted
    and CorruptCheckpoint is raised, so the caller can pick an older target.
    """
    disk.verify_step(root, step)
    disk.update_latest(root, step, backwards=True)  # first: never left naming a deleted step
    doomed = [s for s in disk.list_steps(root) if s > step]
    return sorted(s for s in doomed if remove_step(root, s))
