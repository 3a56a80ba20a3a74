"""The active coordinator's lease on its state directory: who may answer, and for how long.

The state directory's ``flock`` fences a dead coordinator only: a hung one (SIGSTOP, a stalled
host) keeps its lock, and a standby waiting on the lock waits forever. So the active coordinator
also holds a lease: a record per term in a store (:class:`LeaseStore`), here one file per term
in the state directory (``lease-<term>.json``; :mod:`unbroken.control.state.lease_etcd` keeps it in
etcd instead):

- A coordinator that becomes active claims the next term by creating its record exclusively
  (``link``, or ``O_EXCL`` where the filesystem has no hard links: only one claimant of a term
  wins), then renews it every ``renew_s`` by writing the record again with its counter ``seq``
  one higher, in place (a fixed-size record: a full disk does not take the lease away from a
  coordinator that is otherwise fine). The counter is in the content, never a timestamp: on a
  filesystem that keeps whole seconds (ext4 with 128-byte inodes, FAT, many FUSE filesystems)
  most renewals would not change a timestamp, and a standby would take over from a live holder.
  Readers open the record by name each time (on NFS, open revalidates cached data).
- The holder may answer until ``lease_s - renew_s`` after the *start* of its last renewal, by
  its own monotonic clock, and checks that before every answer: a stopped process sees its clock
  jump past that the moment it runs again. After each write it looks for a higher term; one found
  means it was replaced, and it steps down without answering.
- A store that fails (``EIO``, ``ESTALE``, ``EMFILE``) is retried at every renewal; once no
  renewal succeeded for :func:`store_gives_up_after` the holder gives up, and its process exits
  with :data:`EXIT_LEASE_STORE` so that its supervisor restarts it (never a silent fence).
- A standby watches the highest term's record. Once it has not changed for ``lease_s`` of the
  standby's own clock, it claims the next term. It then reads the old record again: unchanged,
  the old holder's answers ended before (each write it made was seen, and its validity ends
  ``renew_s`` before the standby's); changed, the old holder is alive, will see the new term at
  its next renewal, and the new holder waits one more ``lease_s`` before it answers. A read that
  fails or is torn counts as a change: not knowing is never a reason to take over.

The rules are plain functions of what was read and the time passed in (tested without files);
:class:`LeaseFiles` is the thin shell over the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from unbroken.control.state.state_store import StateDirInUse, lock_state_dir

log = logging.getLogger(__name__)

# Why these: a takeover within 2 s of a hang (issue 31) is lease_s plus the standby's start;
# four renewals per lease leave room for an event loop or a disk that is slow for a moment.
DEFAULT_LEASE_S = 1.0
DEFAULT_RENEW_S = 0.25
MAX_LEASE_S = 600.0  # a longer lease read from a file is an error, not a reason to wait for hours
KEEP_TERMS = 3  # older term files are deleted by the next holder: nothing grows without bound
RECORD_BYTES = 512  # a term's record, padded: renewals overwrite it in place, never grow it
# The exit code of a coordinator (or standby) whose lease store kept failing past
# :func:`store_gives_up_after`: EX_IOERR. Its supervisor restarts it; a standby answers meanwhile.
EXIT_LEASE_STORE = 74

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

    def record(self) -> bytes:
        """The record as stored: the JSON padded with spaces to :data:`RECORD_BYTES`, so that a
        renewal rewrites the same bytes in place (JSON allows the trailing blanks)."""
        text = self.to_json().encode()
        if len(text) > RECORD_BYTES:
            raise ValueError(f"a lease record of {len(text)} bytes (at most {RECORD_BYTES}): shorten the address")
        return text.ljust(RECORD_BYTES, b" ")

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


def store_gives_up_after(lease_s: float, renew_s: float) -> float:
    """How long after the start of its last successful renewal a holder whose store fails gives
    up (and its process exits with :data:`EXIT_LEASE_STORE`): a lease and a renewal period, the
    moment a standby may have taken over. A stall shorter than the lease never reaches it; with
    the watchdog's own period the exit comes within two lease periods of the last renewal."""
    return lease_s + renew_s


def standby_gives_up_after(lease_s: float) -> float:
    """How long a standby's store may fail before it exits: longer than a holder's (it answers
    nothing meanwhile, and once the store is back it may be the one to take over), still bounded."""
    return max(30.0, 10 * lease_s)


class LeaseStoreFailed(RuntimeError):
    """The lease store failed for longer than :func:`store_gives_up_after`: exit, be restarted."""


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


@dataclasses.dataclass(frozen=True)
class StoreProbe:
    """What a coordinator measured of its lease store at start."""

    timestamp_ns: int  # the store's timestamp granularity: 1 (nanoseconds) to 2e9 (FAT); informative only
    latency_s: float  # the slowest renewal's calls (open, write, close, read, listing)


def fit_to_store(lease_s: float, renew_s: float, latency_s: float) -> tuple[float, float, str | None]:
    """The lease and renewal periods a store this slow can hold, and why they were widened (None:
    as asked). A renewal's calls must take at most a quarter of the renewal period, or a metadata
    hiccup of a few calls' length lapses the lease."""
    if 4 * latency_s <= renew_s:
        return lease_s, renew_s, None
    renew = round(4 * latency_s, 3)
    lease = max(lease_s, 4 * renew)
    if lease > MAX_LEASE_S:
        raise ValueError(
            f"the lease store takes {latency_s * 1000:.0f} ms per renewal: no lease up to {MAX_LEASE_S}s holds on "
            "it; put the state directory on a faster filesystem"
        )
    why = (
        f"the lease store took up to {latency_s * 1000:.0f} ms per renewal, more than a quarter of the "
        f"{renew_s}s renewal period: lease widened to {lease}s, renewed every {renew}s"
    )
    return lease, renew, why


def mount_problem(fstype: str, options: set[str]) -> str | None:
    """Why a state directory on this mount cannot hold a lease (None: it can). Only what breaks the
    lease itself: coarse timestamps do not (the counter is in the record)."""
    if fstype.startswith("nfs") and "nocto" in options:
        return (
            f"the state directory is on {fstype} mounted with nocto: a standby reads a renewal only once its "
            "attribute cache expires (actimeo, up to a minute) and would take over from a live coordinator; "
            "mount it without nocto, or keep the lease in etcd (--lease-store etcd://HOST:PORT)"
        )
    return None


def mount_of(path: str | Path, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, set[str]] | None:
    """The filesystem type and options (per mount and per superblock) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best: tuple[int, str, set[str]] | None = None
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) > best[0]:
                best = (len(point), tail[0], set(fields[5].split(",")) | set(tail[2].split(",")))
    return None if best is None else (best[1], best[2])


class LeaseStore(Protocol):
    """Where the terms' records live. Every method raises OSError when the store fails (a read
    that finds no record, or one that does not parse, is None: not trusted, never an error)."""

    where: str  # said in messages: the directory, or the etcd endpoints

    def terms(self) -> list[int]: ...

    def read(self, term: int) -> Lease | None: ...

    def newest(self) -> Lease | None: ...

    def claim(self, lease: Lease) -> bool: ...

    def renew(self, lease: Lease) -> None: ...

    def probe(self, rounds: int = 5) -> StoreProbe: ...


class LeaseFiles:
    """The lease records of one state directory: claimed, renewed, read, pruned.

    A claim links a complete file into place (a reader sees no record or a whole one); a renewal
    rewrites the record's fixed-size bytes in place. A record that does not parse (torn by a
    concurrent renewal, or foreign) is skipped, not trusted: to a standby it is a change.
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.where = str(self.dir)

    def path(self, term: int) -> Path:
        return self.dir / f"lease-{term}.json"

    def terms(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))

    def read(self, term: int) -> Lease | None:
        """The term's record, looked up by name and read afresh (never a cached handle)."""
        try:
            with open(self.path(term), "rb") as f:
                data = f.read(RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            lease = Lease.from_json(data.decode(errors="replace"))
        except ValueError:
            return None
        return lease if lease.term == term else None

    def newest(self) -> Lease | None:
        terms = self.terms()
        return self.read(terms[-1]) if terms else None

    def claim(self, lease: Lease) -> bool:
        """Creates ``lease``'s term record; False if another claimant has it already."""
        record = lease.record()
        tmp = self._write_tmp(record)
        try:
            os.link(tmp, self.path(lease.term))
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            if not self._create(lease.term, record):  # no hard links here (FAT, some FUSE filesystems)
                return False
        finally:
            tmp.unlink(missing_ok=True)
        self._sync_dir()
        for old in to_prune(self.terms()):
            self.path(old).unlink(missing_ok=True)
        return True

    def renew(self, lease: Lease) -> None:
        """Rewrites the holder's own record in place (only its holder does); no ``O_CREAT``: a
        record pruned by a later holder is not brought back. Raises OSError."""
        fd = os.open(self.path(lease.term), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, lease.record(), 0)
        finally:
            os.close(fd)  # on NFS, close sends the write to the server (close-to-open)

    def probe(self, rounds: int = 5) -> StoreProbe:
        """Measures the store as a renewal uses it, on a probe file of its own (removed after)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f".lease-probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        record = Lease(term=1, holder="probe").record()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            stamp = 1_700_000_001_999_999_999
            os.utime(path, ns=(stamp, stamp))
            timestamp_ns = stamp - os.stat(path).st_mtime_ns + 1
            latency = 0.0
            for _ in range(rounds):
                t0 = time.monotonic()
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.pwrite(fd, record, 0)
                finally:
                    os.close(fd)
                with open(path, "rb") as f:
                    f.read(RECORD_BYTES + 1)
                os.listdir(self.dir)
                latency = max(latency, time.monotonic() - t0)
        finally:
            path.unlink(missing_ok=True)
        return StoreProbe(timestamp_ns=max(1, timestamp_ns), latency_s=latency)

    def _create(self, term: int, record: bytes) -> bool:
        try:
            fd = os.open(self.path(term), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, record)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _write_tmp(self, record: bytes) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".lease.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, record)
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
        files: the store of the terms' records.
        lease: the term claimed (:meth:`LeaseFiles.claim`).
        claim_started: the holder's clock when the claim started (validity counts from there).
        renew_s: the renewal period.
        active_at: the holder's clock from which it may answer (a takeover that must wait).
        on_lost: called (in the keeper's thread) once a higher term is found.
        clock: the holder's monotonic clock.
    """

    def __init__(
        self,
        files: LeaseStore,
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
        self.last_renewed = claim_started  # the start of the last renewal that reached the store
        self.failing = False  # the last renewal failed (an error), or one is in a call that has not returned
        self.lost_to: Lease | None = None
        self.is_lost = False
        self.renew_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-lease", daemon=True)

    def valid(self, now: float | None = None) -> bool:
        """Whether the holder may answer now: the fence checked before every answer."""
        now = self.clock() if now is None else now
        return not self.is_lost and self.active_at <= now < self.until

    def gave_up(self, now: float | None = None) -> bool:
        """Whether the store failed (errors, or a call that does not return) for longer than
        :func:`store_gives_up_after`: the process must exit with :data:`EXIT_LEASE_STORE`. A
        process that was stopped (SIGSTOP) and runs again has not failed: it renews, and steps
        down if it was replaced."""
        now = self.clock() if now is None else now
        bound = store_gives_up_after(self.lease.lease_s, self.renew_s)
        return not self.is_lost and self.failing and now - self.last_renewed >= bound

    def replaced(self) -> bool:
        """One more look for a higher term (a holder about to exit for its store: if a standby
        took over meanwhile, it stepped down rather than failed). False when the store cannot say."""
        try:
            return self.is_lost or lost(self.lease.term, self.files.terms())
        except OSError:
            return False

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
        lease = dataclasses.replace(self.lease, seq=self.lease.seq + 1)
        self.failing = True  # until the calls return: a call that never does is a failure too
        try:
            if self._check_lost():
                return False
            self.files.renew(lease)
            self.lease = lease
            if self._check_lost():  # a claim that raced this write: the claimant judged by what it read
                return False
        except OSError as e:
            self.renew_failures += 1
            if self.renew_failures & (self.renew_failures - 1) == 0:  # 1st, 2nd, 4th...: no log flood
                log.warning(
                    "cannot renew the coordinator's lease in %s: %s (%d failure(s); the process exits with %d "
                    "if it cannot for %.1fs)",
                    self.files.where,
                    e,
                    self.renew_failures,
                    EXIT_LEASE_STORE,
                    store_gives_up_after(lease.lease_s, self.renew_s),
                )
            return True
        self.failing = False
        self.last_renewed = max(self.last_renewed, started)
        self.until = max(self.until, valid_until(started, lease.lease_s, self.renew_s))
        return True

    def _check_lost(self) -> bool:
        terms = self.files.terms()
        if not lost(self.lease.term, terms):
            return False
        self.is_lost = True
        with contextlib.suppress(OSError):  # who won is for the message only: the step-down is not
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
    files: LeaseStore, lease_s: float, address: str = "", clock: Callable[[], float] = time.monotonic
) -> tuple[Lease, float]:
    """Claims the term after the newest (a coordinator that holds the directory's lock). Raises
    OSError when the store fails."""
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
    files: LeaseStore | None = None,
    gives_up_s: float | None = None,
) -> Takeover | None:
    """A standby's wait: returns once the active coordinator's process is gone (its lock is
    free) or its lease lapsed (it hangs); None once ``stop`` is set.

    A store that fails restarts the count (not knowing is no reason to take over) and is
    retried; failing for longer than ``gives_up_s`` (:func:`standby_gives_up_after`) raises
    LeaseStoreFailed."""
    gives_up_s = standby_gives_up_after(lease_s) if gives_up_s is None else gives_up_s
    store: LeaseStore = LeaseFiles(state_dir) if files is None else files
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    watch = Watch()
    failing_since: float | None = None
    failures = 0
    while not stop.is_set():
        lock_fd: int | None = None
        try:
            try:
                lock_fd = lock_state_dir(Path(state_dir))
            except StateDirInUse:
                lock_fd = None
            now = clock()
            watch = watch.observe(store.newest(), now)
            if lock_fd is not None:
                lease, started = claim_next(store, lease_s, clock=clock)
                return Takeover(lease, started, clock(), lock_fd)
            if watch.expired(now, lease_s):
                started = clock()
                lease = Lease(term=next_term(store.terms()), holder=holder_id(), lease_s=lease_s)
                if not store.claim(lease):  # another standby was first: watch it instead
                    watch = Watch()
                    continue
                old = watch.seen
                reread = store.read(old.term) if old is not None else None
                return Takeover(lease, started, watch.active_at(reread, clock(), lease_s), None)
            failing_since = None
        except OSError as e:
            if lock_fd is not None:
                os.close(lock_fd)
            now = clock()
            failing_since = now if failing_since is None else failing_since
            failures += 1
            watch = Watch()
            if failures & (failures - 1) == 0:
                log.warning("standby: cannot read the lease in %s: %s (%d failure(s))", store.where, e, failures)
            if now - failing_since >= gives_up_s:
                raise LeaseStoreFailed(
                    f"the lease store {store.where} failed for {now - failing_since:.1f}s ({failures} errors, "
                    f"the last: {e})"
                ) from e
        stop.wait(poll_s)
    return None
