"""Which checkpoints belong to the job's current history, after rollbacks.

A rollback to step S undoes every step after S: their state holds the damage the rollback
removes. Deleting them is not enough: a delete can fail (the supervisor then keeps them and says
so), a peer store keeps the last copy pushed to it, and a restarted process would load the
newest step it finds, after which the quorum pulls every replica to it. So the rollback is
recorded in the checkpoint directory before any process is stopped: a *fence* says "history
``h`` began at step S". Every checkpoint records the history its process started in
(``ShardManifest.extra["history"]``; none: 0), and a step of history ``g`` is loadable only if
every fence of a later history lies at or above it. Steps the new history saves again (S+5 is
saved anew after a rollback to S) are of the new history and load.

The fences live in ``rollbacks.json`` next to the steps (JSON, 0600, replaced atomically). A
file that cannot be read refuses every load rather than letting the undone history back in.
At most :data:`MAX_FENCES` are kept: the two oldest merge into one that is stricter than
both, which can only make an old history's step unloadable, never an undone one loadable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from typing import Any

FENCE_FILE = "rollbacks.json"
HISTORY_KEY = "history"
MAX_FENCES = 64


@dataclasses.dataclass(frozen=True)
class Fence:
    """History ``history`` began with a rollback to ``step``."""

    history: int
    step: int


@dataclasses.dataclass(frozen=True)
class Fences:
    """Every rollback of the job, oldest first."""

    fences: tuple[Fence, ...] = ()

    @property
    def current(self) -> int:
        """The history a process starting now saves in."""
        return max((f.history for f in self.fences), default=0)

    def ceiling(self, history: int) -> int | None:
        """The newest step of ``history`` still loadable (None: no limit)."""
        steps = [f.step for f in self.fences if f.history > history]
        return min(steps) if steps else None

    def undone(self, step: int, history: int) -> str | None:
        """Why ``step`` of ``history`` is from an undone history, or None if it loads."""
        ceiling = self.ceiling(history)
        if ceiling is None or step <= ceiling:
            return None
        return f"step {step} is from a history undone by the rollback to step {ceiling}"

    def after_rollback(self, step: int) -> Fences:
        """These fences and a new history beginning at ``step``."""
        if step < 0:
            raise ValueError(f"a rollback's step is 0 or more, got {step}")
        fences = [*self.fences, Fence(self.current + 1, step)]
        while len(fences) > MAX_FENCES:
            a, b = fences[0], fences[1]
            fences[:2] = [Fence(b.history, min(a.step, b.step))]
        return Fences(tuple(fences))

    def to_json(self) -> str:
        return json.dumps({"fences": [[f.history, f.step] for f in self.fences]})

    @classmethod
    def from_json(cls, text: str) -> Fences:
        """Parses the file; a damaged one is a ValueError naming the problem."""
        try:
            raw = json.loads(text)
            rows = raw["fences"]
            if not isinstance(rows, list) or len(rows) > MAX_FENCES:
                raise ValueError("fences is not a list of at most 64 rows")
            fences = []
            for row in rows:
                if not (isinstance(row, list) and len(row) == 2 and all(_is_count(x) for x in row)):
                    raise ValueError(f"a fence is [history, step], two integers >= 0, got {row!r:.80}")
                fences.append(Fence(row[0], row[1]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{FENCE_FILE} is damaged ({e}); it records the job's rollbacks") from None
        return cls(tuple(fences))


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read(root: str) -> Fences:
    """The fences of checkpoint directory ``root`` (none when it has no rollback yet).

    Raises:
        ValueError: the file exists and cannot be read: no step may load until it can (a
            :class:`~unbroken.checkpoint.storage.disk.CorruptCheckpoint` from :func:`disk.fences`).
    """
    try:
        with open(os.path.join(root, FENCE_FILE)) as f:
            text = f.read()
    except FileNotFoundError:
        return Fences()
    except OSError as e:
        raise ValueError(f"cannot read {FENCE_FILE} in {root}: {e}") from e
    return Fences.from_json(text)


def record_rollback(root: str, step: int) -> Fences:
    """Records a rollback to ``step`` durably (before any process is stopped); returns the fences."""
    fences = read(root).after_rollback(step)
    tmp = os.path.join(root, f".{FENCE_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, fences.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(root, FENCE_FILE))
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return fences


def history_of(extra: dict[str, Any]) -> int:
    """The history a manifest's ``extra`` names (0: saved before any rollback, or by an older
    version); a value that is not a count is damage."""
    value = extra.get(HISTORY_KEY, 0)
    if not _is_count(value):
        raise ValueError(f"the manifest's history is not an integer >= 0: {value!r:.40}")
    return int(value)
