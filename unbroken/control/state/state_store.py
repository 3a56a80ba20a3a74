"""The coordinator's durable state: the epochs it may issue and a bounded event history.

SQLite in the state directory, so a restarted coordinator continues with higher epochs (a
replica can never see an epoch number reused) and the recent history survives.

Why these settings:

- A rollback journal (``journal_mode=DELETE``), not WAL: WAL keeps its index in shared memory
  (``-shm``), which is unsafe on a network filesystem, and the README's Slurm example puts the
  state directory on one. WAL is an opt-in for a local disk (``journal_mode="wal"``).
- ``synchronous=FULL``: a commit is on the disk before the call returns. With ``NORMAL`` a
  power loss can undo the last commits, and a restarted coordinator would issue an epoch
  number that replicas have already seen.
- Epochs are reserved in blocks (``epoch_ceiling``) before they are issued, and a restarted
  coordinator starts above the reserved ceiling. An epoch issued in the instant before a
  crash, or while the disk was full and its history row could not be written, is therefore
  never issued again; and a full disk does not stop the job from forming epochs until a
  whole block is spent.
- One coordinator per state directory, enforced with an exclusive ``flock`` on
  ``coordinator.lock`` (released by the kernel if the holder dies): two coordinators on one
  directory would issue the same epochs to different replicas.
- Events and the epochs' history rows are queued and written by a writer thread
  (:meth:`StateStore.persist`), in one transaction per round: a synced commit can take tens of
  milliseconds, which the coordinator's event loop must not wait for. Only the newest
  ``keep_events`` events stay (``events.jsonl`` next to it holds the full history), and only
  the newest ``keep_epochs`` epochs: nothing reads older ones.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOURNAL_MODES = ("delete", "truncate", "wal")
EPOCH_BLOCK = 1000
KEEP_EVENTS = 10_000
# The newest epochs the history keeps: a restart continues the last (:meth:`StateStore.last_epoch`)
# and issues above the highest; older rows only grew the file (28 KB each at 5,000 replicas).
KEEP_EPOCHS = 100


class StateDirInUse(ValueError):
    """Another live coordinator holds this state directory."""


class StateStore:
    """Epochs and events of one job, in ``state_dir/coordinator.sqlite``.

    Args:
        state_dir: the directory (created if missing).
        journal_mode: ``delete`` (default), ``truncate`` or ``wal`` (only on a local disk).
        keep_events: how many of the newest events the database keeps.
        keep_epochs: how many of the newest epochs the database keeps (at least 1: the last is
            what a restarted coordinator continues, the highest what it issues above).
        epoch_block: how many epochs one reservation covers.
        lock_fd: the directory's lock, already taken (:func:`wait_for_state_dir`, a standby's
            takeover); None takes it here, unless ``fenced``.
        fenced: the directory is held through the lease (:mod:`unbroken.control.state.lease`): a
            standby took over from a hung coordinator that still holds the lock, so none is taken.

    Raises:
        StateDirInUse: another coordinator runs on ``state_dir``.
        ValueError: the directory cannot be created or the database opened.
    """

    def __init__(
        self,
        state_dir: str | Path,
        journal_mode: str = "delete",
        keep_events: int = KEEP_EVENTS,
        epoch_block: int = EPOCH_BLOCK,
        lock_fd: int | None = None,
        fenced: bool = False,
        keep_epochs: int = KEEP_EPOCHS,
    ) -> None:
        if journal_mode.lower() not in JOURNAL_MODES:
            raise ValueError(f"journal mode must be one of {', '.join(JOURNAL_MODES)}, got {journal_mode!r}")
        if keep_events < 1 or epoch_block < 2 or keep_epochs < 1:
            raise ValueError(
                "keep_events and keep_epochs must be >= 1 and epoch_block >= 2, "
                f"got {keep_events}, {keep_epochs}, {epoch_block}"
            )
        path = Path(state_dir)
        try:
            private_dir(path)
        except OSError as e:
            raise ValueError(f"cannot create the coordinator state directory {path}: {e}") from e
        self.keep_events = keep_events
        self.keep_epochs = keep_epochs
        self.epoch_block = epoch_block
        self.write_failures = 0  # history rows (epochs, events) that could not be written
        self._lock_fd: int | None = lock_fd if lock_fd is not None or fenced else lock_state_dir(path)
        self._closed = False
        # Written by a writer thread (see :meth:`persist`), queued by the event loop: the queue
        # lock is held only to swap rows in and out, never across a write.
        self._db_lock = threading.RLock()
        self._queue_lock = threading.Lock()
        self._events: list[tuple[float, str, str]] = []
        self._epochs: list[tuple[int, int, str, str, float]] = []
        self._since_prune = keep_events  # prune at the first flush: an older run may have left many
        self.path = path / "coordinator.sqlite"
        try:
            private_file(self.path)  # sqlite gives its -wal, -shm and -journal the database's mode
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            mode = self._db.execute(f"PRAGMA journal_mode={journal_mode.upper()}").fetchone()[0]
            if str(mode).lower() != journal_mode.lower():
                raise sqlite3.OperationalError(f"the database stays in journal mode {mode}")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS epochs (epoch INTEGER PRIMARY KEY, step INTEGER, "
                "members TEXT, behind TEXT, t REAL)"
            )
            self._db.execute("CREATE TABLE IF NOT EXISTS events (t REAL, kind TEXT, data TEXT)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER)")
            row = self._db.execute("SELECT value FROM meta WHERE key = 'epoch_ceiling'").fetchone()
            self._ceiling = int(row[0]) if row else 0
            # Every epoch a previous coordinator may have issued is at or below this floor.
            self.epoch_floor = max(self._max_recorded_epoch(), self._ceiling)
            self.reserve_epochs(self.epoch_floor)
        except sqlite3.Error as e:
            self._release()
            raise ValueError(
                f"cannot use the coordinator state in {self.path}: {e}; "
                "is the state directory writable and not full?"
            ) from e

    # -- epochs ------------------------------------------------------------------------------

    @property
    def epoch_ceiling(self) -> int:
        """The highest epoch that may be issued: reserved durably before it is handed out."""
        return self._ceiling

    def reserve_epochs(self, issued: int) -> int:
        """Makes sure at least half a block of epochs above ``issued`` is reserved on disk.

        Returns the ceiling. Raises ``sqlite3.Error`` if the reservation cannot be written (the
        caller keeps the old ceiling and must not issue past it).
        """
        with self._db_lock:
            if self._ceiling - issued >= self.epoch_block // 2:
                return self._ceiling
            ceiling = issued + self.epoch_block
            # Never lowered: a coordinator that lost its lease and wakes up may still write here.
            self._db.execute(
                "INSERT INTO meta VALUES ('epoch_ceiling', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = MAX(value, excluded.value)",
                (ceiling,),
            )
            self._ceiling = ceiling
            return ceiling

    def max_epoch(self) -> int:
        """The highest epoch recorded in the history (issued epochs may be higher; see above)."""
        with self._db_lock:
            self.flush()
            return self._max_recorded_epoch()

    def _max_recorded_epoch(self) -> int:
        row = self._db.execute("SELECT MAX(epoch) FROM epochs").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def last_epoch(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
        """The newest epoch in the history (epoch, step it was formed at, members, behind), or
        None when there is none or its row does not read as one (then nothing is continued)."""
        with self._db_lock:
            row = self._db.execute(
                "SELECT epoch, step, members, behind FROM epochs ORDER BY epoch DESC LIMIT 1"
            ).fetchone()
        if row is None:
            return None
        try:
            members, behind = json.loads(row[2]), json.loads(row[3])
            if not all(type(m) is int and m >= 0 for m in [*members, *behind]) or not set(behind) <= set(members):
                raise ValueError("ids that are not a set of members")
            return int(row[0]), int(row[1]), tuple(sorted(set(members))), tuple(sorted(set(behind)))
        except (TypeError, ValueError) as e:
            log.warning("the last epoch in %s does not read (%s): it is not continued", self.path, e)
            return None

    def record_epoch(self, epoch: int, step: int, members: list[int], behind: list[int]) -> None:
        """Queues an issued epoch for the history (its number is already safe: see the ceiling)."""
        with self._queue_lock:
            self._epochs.append((epoch, step, json.dumps(members), json.dumps(behind), time.time()))
            del self._epochs[: -self.keep_events]

    # -- events ------------------------------------------------------------------------------

    def record_event(self, event: dict[str, Any]) -> None:
        """Queues an event for the next :meth:`flush` (the oldest are dropped past ``keep_events``)."""
        row = (float(event.get("t", time.time())), str(event.get("kind", "")), json.dumps(event, default=str))
        with self._queue_lock:
            self._events.append(row)
            del self._events[: -self.keep_events]

    def persist(self, issued: int) -> int:
        """Reserves epochs ahead of ``issued`` and writes what is queued; returns the ceiling.

        Blocks on the disk (each commit is synced: tens of milliseconds on some disks), so the
        coordinator calls it from a writer thread, never from its event loop. Never raises.
        """
        with self._db_lock:
            try:
                self.reserve_epochs(issued)
            except sqlite3.Error as e:
                self._failed("the epoch reservation", e)
                if issued >= self._ceiling:
                    log.error("no epoch above %d may be issued until %s is writable again", issued, self.path)
            self.flush()
            return self._ceiling

    def flush(self) -> bool:
        """Writes the queued rows in one transaction and prunes the oldest events and epochs; False if it
        failed (the rows stay queued, the oldest dropped past ``keep_events``, for the next try)."""
        with self._db_lock:
            with self._queue_lock:
                events, self._events = self._events, []
                epochs, self._epochs = self._epochs, []
            prune = self._since_prune + len(events) >= max(1, self.keep_events // 10)
            if not events and not epochs and not prune:
                return True
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.executemany("INSERT OR REPLACE INTO epochs VALUES (?, ?, ?, ?, ?)", epochs)
                    self._db.executemany("INSERT INTO events VALUES (?, ?, ?)", events)
                    if prune:
                        self._db.execute(
                            "DELETE FROM events WHERE rowid <= (SELECT MAX(rowid) FROM events) - ?",
                            (self.keep_events,),
                        )
                    if epochs or prune:  # by the primary key: a lookup and a range, not a scan
                        self._db.execute(
                            "DELETE FROM epochs WHERE epoch < "
                            "(SELECT epoch FROM epochs ORDER BY epoch DESC LIMIT 1 OFFSET ?)",
                            (self.keep_epochs - 1,),
                        )
                    self._db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                with self._queue_lock:
                    self._events = (events + self._events)[-self.keep_events :]
                    self._epochs = (epochs + self._epochs)[-self.keep_events :]
                self._failed(f"{len(epochs)} epoch(s) and {len(events)} event(s)", e)
                return False
            self._since_prune = 0 if prune else self._since_prune + len(events)
            return True

    def events(self) -> list[dict[str, Any]]:
        """The events kept, oldest first."""
        with self._db_lock:
            self.flush()
            rows = list(self._db.execute("SELECT data FROM events ORDER BY rowid"))
        with self._queue_lock:
            queued = list(self._events)  # only if the flush failed
        return [json.loads(r[0]) for r in rows] + [json.loads(data) for (_, _, data) in queued]

    def adopt_lock(self) -> bool:
        """Takes the directory's lock if it is free and not held yet: a coordinator that took
        over through the lease holds it once the hung one it replaced is gone, so that a plain
        coordinator started on this directory is refused. True once held."""
        if self._lock_fd is not None or self._closed:
            return self._lock_fd is not None
        try:
            self._lock_fd = lock_state_dir(self.path.parent)
        except (StateDirInUse, OSError):
            return False
        return True

    # -- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._db.close()
        self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None

    def _failed(self, what: str, e: sqlite3.Error) -> None:
        self.write_failures += 1
        if self.write_failures & (self.write_failures - 1) == 0:  # 1st, 2nd, 4th...: not a flood
            log.warning(
                "cannot write %s to %s (%s): %d write(s) failed so far; the job goes on",
                what,
                self.path,
                e,
                self.write_failures,
            )


def wait_for_state_dir(path: str | Path, stop: threading.Event, poll_s: float = 0.02) -> int | None:
    """Waits until no live coordinator holds ``path`` and takes its lock: a standby's wait.

    The kernel drops the active coordinator's ``flock`` the moment its process dies (``kill -9``
    included), so this returns within ``poll_s`` of that death; the lock is the fence, since
    two coordinators cannot both hold it. Returns the lock's descriptor (for
    :class:`StateStore`), or None once ``stop`` is set.
    """
    directory = Path(path)
    private_dir(directory)
    while not stop.is_set():
        try:
            return lock_state_dir(directory)
        except StateDirInUse:
            stop.wait(poll_s)
    return None


_NO_MODES = (errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)  # chmod on a filesystem without modes


def private_dir(path: Path) -> None:
    """Makes ``path`` (and its parents) and leaves it 0700, whatever the umask and its mode was.

    The state directory holds the job's secret, its epochs and its leases: another user on the
    machine must not read them (nor, in a directory others may write, swap them)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            if e.errno in _NO_MODES:  # FAT and some FUSE filesystems keep no modes: the mount's own say
                log.warning("%s keeps no file modes (%s): its mount options decide who may read it", path, e)
                return
            if not isinstance(e, PermissionError):
                raise
            raise PermissionError(
                f"the coordinator state directory {path} is mode {stat.S_IMODE(st.st_mode):o} and belongs to "
                f"uid {st.st_uid}, not to this user: give the coordinator a --state-dir of its own"
            ) from None


def private_file(path: Path) -> None:
    """Creates ``path`` 0600 if it is missing, and leaves it 0600 if it was not."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            try:
                os.fchmod(fd, 0o600)
            except OSError as e:
                if e.errno not in _NO_MODES:
                    raise
    finally:
        os.close(fd)


def lock_state_dir(path: Path) -> int:
    """Takes ``path/coordinator.lock`` exclusively, or says who holds it."""
    lock = path / "coordinator.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirInUse(
            f"another coordinator ({holder}) is running on the state directory {path}: two would issue "
            "the same epochs; stop it, or give this job its own --state-dir (--run-dir for `unbroken run`)"
        ) from e
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
    return fd
