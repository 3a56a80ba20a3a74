"""The active coordinator's lease on its state directory: who may answer, and for how long.

The state directory's ``flock`` fences a dead coordinator only: a hung one (SIGSTOP, a stalled
host) keeps its lock, and a standby waiting on the lock waits forever. So the active coordinator
also holds a lease, one file per term in the state directory (``lease-<term>.json``):

- A coordinator that becomes active claims the next term by creating its file exclusively
  (``link``: only one claimant of a term wins), then renews it every ``renew_s`` by setting the
  file's modification time to a new stamp (``seq``, nanoseconds, always increasing): no data is
  written, so a full disk (or a file size limit) does not take the lease away from a coordinator
  that is otherwise fine. Readers open the file (on NFS, open revalidates cached attributes).
- The holder may answer until ``lease_s - margin`` after the *start* of its last renewal, by its
  own monotonic clock, and checks that before every answer: a stopped process sees its clock jump
  past that the moment it runs again. After each write it looks for a higher term; one found
  means it was replaced, and it steps down without answering.
- A standby watches the highest term's file. Once its content has not changed for ``lease_s`` of
  the standby's own clock, it claims the next term. It then reads the old file again: unchanged,
  the old holder's answers ended before (each write it made was seen, and its validity ends
  ``margin`` before the standby's); changed, the old holder is alive, will see the new term at
  its next renewal, and the new holder waits one more ``lease_s`` before it answers.

The rules are plain functions of what was read and the time passed in (tested without files);
:class:`LeaseFiles` is the thin shell over the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.state_store import StateDirInUse, lock_state_dir

log = logging.getLogger(__name__)

# Why these: a takeover within 2 s of a hang (issue 31) is lease_s plus the standby's start;
# four renewals per lease leave room for an event loop or a disk that is slow for a moment.
DEFAULT_LEASE_S = 1.0
DEFAULT_RENEW_S = 0.25
MAX_LEASE_S = 600.0  # a longer lease read from a file is an error, not a reason to wait for hours
KEEP_TERMS = 3  # older term files are deleted by the next holder: nothing grows without bound

_NAME = re.compile(r"^lease-(\d{1,18})\.json$")


@dataclasses.dataclass(frozen=True)
class Lease:
    """One term's file: who holds it, the renewal count, and how long a renewal lasts."""

    term: int
    holder: str
    seq: int = 0
    lease_s: float = DEFAULT_LEASE_S
    address: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Lease:
        """Raises ValueError on anything but a well-formed lease (a torn or foreign file)."""
        try:
            d: Any = json.loads(text)
            lease = cls(
                term=int(d["term"]),
                holder=str(d["holder"]),
                seq=int(d["seq"]),
                lease_s=float(d["lease_s"]),
                address=str(d.get("address", "")),
            )
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"not a lease: {e}") from e
        if lease.term < 1 or lease.seq < 0 or not 0 < lease.lease_s <= MAX_LEASE_S:
            raise ValueError(f"a lease with term >= 1, seq >= 0 and 0 < lease_s <= {MAX_LEASE_S}, got {lease}")
        return lease


def check_periods(lease_s: float, renew_s: float) -> None:
    """Raises ValueError unless a renewal fits at least twice in a lease."""
    if not (0 < renew_s and 2 * renew_s <= lease_s <= MAX_LEASE_S):
        raise ValueError(
            f"the lease ({lease_s}s) must be at least twice its renewal period ({renew_s}s) and at most "
            f"{MAX_LEASE_S}s: a holder must renew at least once before its lease runs out"
        )


def valid_until(renew_started: float, lease_s: float, renew_s: float) -> float:
    """Until when (the holder's monotonic clock) a renewal that started at ``renew_started``
    lets the holder answer: one renewal period short of the lease, so that it stops before
    any standby, which counts from when it saw the write (after it started), may take over."""
    return renew_started + lease_s - renew_s


def lost(term: int, terms: list[int]) -> bool:
    """Whether a holder of ``term`` was replaced: a higher term was claimed."""
    return any(t > term for t in terms)


def next_term(terms: list[int]) -> int:
    return max(terms, default=0) + 1


def to_prune(terms: list[int], keep: int = KEEP_TERMS) -> list[int]:
    """The term files a new holder deletes: all but the newest ``keep``."""
    return sorted(terms)[:-keep] if keep > 0 else sorted(terms)


@dataclasses.dataclass(frozen=True)
class Watch:
    """A standby's view of the newest lease: what it read last, and since when (its clock)."""

    seen: Lease | None = None
    since: float | None = None  # None: nothing read yet

    def observe(self, lease: Lease | None, now: float) -> Watch:
        """A read of the newest lease at ``now``: a change (a renewal, a new term) restarts the count."""
        if lease == self.seen and self.since is not None:
            return self
        return Watch(lease, now)

    def expired(self, now: float, lease_s: float) -> bool:
        """Whether the holder let its lease lapse: nothing changed for the longer of ``lease_s``
        (the standby's) and the holder's own. No lease file counts as unchanged content too (an
        active coordinator between taking its lock and claiming its term)."""
        if self.since is None:
            return False
        return now - self.since >= max(lease_s, self.seen.lease_s if self.seen is not None else 0.0)

    def active_at(self, reread: Lease | None, now: float, lease_s: float) -> float:
        """When a standby that just claimed the next term may answer, given the old term's file
        read again after the claim: at once if it is unchanged, else one lease later (the old
        holder renewed in between: it sees the new term at its next renewal and stops by then)."""
        if reread == self.seen:
            return now
        return now + max(lease_s, reread.lease_s if reread is not None else 0.0)


def holder_id() -> str:
    """Unique per process and start: a restarted coordinator is a new holder."""
    return f"pid {os.getpid()} on {os.uname().nodename} ({uuid.uuid4().hex[:8]})"


class LeaseFiles:
    """The lease files of one state directory: claimed, renewed, read, pruned.

    Every write is of a whole file renamed (or linked) into place, so a reader sees an old
    lease or a new one, never a torn one; a file that does not parse is skipped, not trusted.
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)

    def path(self, term: int) -> Path:
        return self.dir / f"lease-{term}.json"

    def terms(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))

    def read(self, term: int) -> Lease | None:
        """The term's lease, its ``seq`` the file's renewal stamp (its modification time)."""
        try:
            with open(self.path(term), "rb") as f:
                stamp = os.fstat(f.fileno()).st_mtime_ns
                lease = Lease.from_json(f.read(4096).decode(errors="replace"))
        except (OSError, ValueError):
            return None
        return dataclasses.replace(lease, seq=stamp) if lease.term == term else None

    def newest(self) -> Lease | None:
        terms = self.terms()
        return self.read(terms[-1]) if terms else None

    def claim(self, lease: Lease) -> bool:
        """Creates ``lease``'s term file; False if another claimant has it already."""
        tmp = self._write_tmp(lease)
        try:
            os.link(tmp, self.path(lease.term))
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._sync_dir()
        for old in to_prune(self.terms()):
            self.path(old).unlink(missing_ok=True)
        return True

    def renew(self, lease: Lease) -> None:
        """Stamps the holder's own term file with ``lease.seq`` (only its holder does). Raises OSError."""
        os.utime(self.path(lease.term), ns=(lease.seq, lease.seq))

    def _write_tmp(self, lease: Lease) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".lease-{lease.term}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, lease.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def _sync_dir(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class LeaseKeeper:
    """Holds one term: renews it in a thread of its own and is the coordinator's fence.

    A thread, not a task of the coordinator's event loop: a loop busy for a moment must not let
    the lease lapse, and a lapse must be seen by :meth:`valid` even while the loop is stalled.

    Args:
        files: the state directory's lease files.
        lease: the term claimed (:meth:`LeaseFiles.claim`).
        claim_started: the holder's clock when the claim started (validity counts from there).
        renew_s: the renewal period.
        active_at: the holder's clock from which it may answer (a takeover that must wait).
        on_lost: called (in the keeper's thread) once a higher term is found.
        clock: the holder's monotonic clock.
    """

    def __init__(
        self,
        files: LeaseFiles,
        lease: Lease,
        claim_started: float,
        renew_s: float = DEFAULT_RENEW_S,
        active_at: float = 0.0,
        on_lost: Callable[[Lease | None], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_periods(lease.lease_s, renew_s)
        self.files, self.lease, self.renew_s = files, lease, renew_s
        self.active_at, self.on_lost, self.clock = active_at, on_lost, clock
        self.until = valid_until(claim_started, lease.lease_s, renew_s)
        self.lost_to: Lease | None = None
        self.is_lost = False
        self.renew_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-lease", daemon=True)

    def valid(self, now: float | None = None) -> bool:
        """Whether the holder may answer now: the fence checked before every answer."""
        now = self.clock() if now is None else now
        return not self.is_lost and self.active_at <= now < self.until

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def renew_once(self) -> bool:
        """One renewal; False once the term is lost (and ``on_lost`` was called)."""
        started = self.clock()
        if self._check_lost():
            return False
        lease = dataclasses.replace(self.lease, seq=max(self.lease.seq + 1, time.time_ns()))
        try:
            self.files.renew(lease)
        except OSError as e:
            self.renew_failures += 1
            if self.renew_failures & (self.renew_failures - 1) == 0:
                log.warning(
                    "cannot renew the coordinator's lease in %s: %s (it lapses if this goes on)", self.files.dir, e
                )
            return True
        self.lease = lease
        if self._check_lost():  # a claim that raced this write: the claimant judged by what it read
            return False
        self.until = max(self.until, valid_until(started, lease.lease_s, self.renew_s))
        return True

    def _check_lost(self) -> bool:
        terms = self.files.terms()
        if not lost(self.lease.term, terms):
            return False
        self.is_lost = True
        self.lost_to = self.files.read(max(terms))
        self.on_lost(self.lost_to)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            if not self.renew_once():
                return


@dataclasses.dataclass(frozen=True)
class Takeover:
    """What a standby won: the term it claimed, and the lock if the old holder was gone."""

    lease: Lease
    claim_started: float
    active_at: float
    lock_fd: int | None  # None: taken over by the lease while the old holder still holds the lock


def claim_next(
    files: LeaseFiles, lease_s: float, address: str = "", clock: Callable[[], float] = time.monotonic
) -> tuple[Lease, float]:
    """Claims the term after the newest (a coordinator that holds the directory's lock)."""
    while True:
        started = clock()
        lease = Lease(term=next_term(files.terms()), holder=holder_id(), lease_s=lease_s, address=address)
        if files.claim(lease):
            return lease, started


def wait_for_takeover(
    state_dir: str | Path,
    stop: threading.Event,
    lease_s: float = DEFAULT_LEASE_S,
    poll_s: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
) -> Takeover | None:
    """A standby's wait: returns once the active coordinator's process is gone (its lock is
    free) or its lease lapsed (it hangs); None once ``stop`` is set."""
    files = LeaseFiles(state_dir)
    files.dir.mkdir(parents=True, exist_ok=True)
    watch = Watch()
    while not stop.is_set():
        try:
            lock_fd: int | None = lock_state_dir(files.dir)
        except StateDirInUse:
            lock_fd = None
        now = clock()
        watch = watch.observe(files.newest(), now)
        if lock_fd is not None:
            lease, started = claim_next(files, lease_s, clock=clock)
            return Takeover(lease, started, clock(), lock_fd)
        if watch.expired(now, lease_s):
            started = clock()
            lease = Lease(term=next_term(files.terms()), holder=holder_id(), lease_s=lease_s)
            if not files.claim(lease):  # another standby was first: watch it instead
                watch = Watch()
                continue
            old = watch.seen
            reread = files.read(old.term) if old is not None else None
            return Takeover(lease, started, watch.active_at(reread, clock(), lease_s), None)
        stop.wait(poll_s)
    return None
