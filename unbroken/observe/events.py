"""Structured events: what happened, to whom, when, and why.

Every component writes events through an :class:`EventLog`; they land as JSON lines in the run
directory so a person (or the report) can read afterwards what broke and what was done.

Each event is a dataclass of :mod:`unbroken.observe.schema`; the log stamps it with its source,
writes its JSON line and hands the typed event to the subscribers.

Writing an event is never worth more than the work it records: a full disk or a failing
subscriber is logged and counted, and the caller (the coordinator's timer, a connection, the
supervisor) goes on. Losing a line of history is a nuisance; a coordinator that stops evicting
dead replicas stalls the whole job.

The file rotates as logrotate or ``RotatingFileHandler`` would: once it passes ``max_bytes`` it
becomes ``events.jsonl.1`` (the older ``.1`` becomes ``.2``...) and at most ``backups`` old files
are kept, so a long job's history is bounded. Several processes append to one file (the launcher
and the coordinator): the one that rotates holds a lock on the file while it renames, and each
writer reopens the path when it no longer names the file it holds. :func:`read_jsonl` reads the
old files first, oldest first.

The files are the job's own (they name hosts, ports, paths and stacks): created 0600.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unbroken.observe import schema
from unbroken.observe.schema import Event

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_BACKUPS = 4
# emit_soon's events written in one append, at most: a bounded write, whatever the burst.
SOON_BATCH = 1024


class EventLog:
    """Appends events to ``path`` (JSONL) and hands each to the subscribers.

    Args:
        path: the JSONL file; None keeps events in memory only.
        source: who writes (``coordinator``, ``launcher``, ``replica-2``...).
        max_bytes: the file rotates once an append takes it past this size.
        backups: rotated files kept (``path.1`` newest ... ``path.N`` oldest); 0 keeps none.

    Attributes:
        write_failures: events that could not be appended to ``path`` (disk full, I/O error).
        rotate_failures: rotations that failed (the file grows on until one succeeds).
        subscriber_failures: subscriber calls that raised.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        source: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
    ) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"max_bytes must be >= 1 and backups >= 0, got {max_bytes} and {backups}")
        self.source = source
        self.max_bytes = max_bytes
        self.backups = backups
        self.path = None if path is None else Path(path)
        self.write_failures = 0
        self.subscriber_failures = 0
        self.rotate_failures = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # the last append failed part-way: the next one starts a fresh line
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._open()
        self._subscribers: list[Callable[[Event], None]] = []
        self._soon: list[Event] = []  # emit_soon's, not written yet
        self._soon_lock = threading.Lock()

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        self._subscribers.append(fn)

    def emit(self, event: Event | str, **fields: Any) -> Event:
        """Writes ``event`` and hands it to the subscribers.

        ``emit("kind", field=...)`` builds the schema's class of that kind
        (:func:`unbroken.observe.schema.build`): a field the kind does not have raises
        ``TypeError`` here, at the writer, not in a reader months later.
        """
        if isinstance(event, str):
            event = schema.build(event, **fields)
        elif fields:
            raise TypeError("emit(event) takes no fields: they are the event's")
        if self._soon:  # the log keeps the order events were emitted in
            self._write_soon()
        return self._write(event)

    def emit_soon(self, event: Event, after_s: float = 0.0) -> None:
        """Writes ``event`` once the running event loop's current turn is over (``after_s``
        later, if given), in order with every other event (an :meth:`emit` meanwhile writes it first).

        For a burst of work whose answers matter more than its record: a standby taking over
        welcomes thousands of replicas in one turn, and each one's event would otherwise delay
        every answer after it by the time it takes to write."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs in this thread: no turn to wait for
            self.emit(event)
            return
        with self._soon_lock:
            self._soon.append(event)
            first = len(self._soon) == 1
        if first:
            if after_s > 0:
                loop.call_later(after_s, self._write_soon)
            else:
                loop.call_soon(self._write_soon)

    def _write_soon(self) -> None:
        """Writes what :meth:`emit_soon` queued with one append: a takeover's 12,500 events were
        four system calls each (the write, and the checks for a rotation)."""
        with self._soon_lock:
            soon, self._soon = self._soon, []
        if not soon:
            return
        events = [self._stamped(e) for e in soon]
        with self._lock:
            if self._fd is not None:
                for i in range(0, len(events), SOON_BATCH):
                    batch = events[i : i + SOON_BATCH]
                    self._append(b"".join(_line(e) for e in batch), len(batch))
        for event in events:
            self._hand_out(event)

    def _stamped(self, event: Event) -> Event:
        return event if event.source else dataclasses.replace(event, source=self.source)

    def _write(self, event: Event) -> Event:
        event = self._stamped(event)
        with self._lock:
            if self._fd is not None:
                self._append(_line(event))
        self._hand_out(event)
        return event

    def _hand_out(self, event: Event) -> None:
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception:
                self.subscriber_failures += 1
                log.exception("an event subscriber failed on %r; the event is dropped for it", event.KIND)

    def _open(self) -> int:
        # One O_APPEND write per event: nothing is left in a user-space buffer after a failed
        # write to be flushed, out of place, with a later event.
        assert self.path is not None
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _follow(self) -> None:
        """Reopens the path if another writer rotated the file this one holds."""
        assert self._fd is not None and self.path is not None
        held = os.fstat(self._fd)
        if not stat.S_ISREG(held.st_mode):
            return  # a device (/dev/full in a test, a pipe): nothing rotates
        try:
            now = os.stat(self.path)
            if (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                return
        except FileNotFoundError:
            pass
        fd = self._open()
        os.close(self._fd)
        self._fd, self._torn = fd, False

    def _rotate(self) -> None:
        """Renames the file to ``.1`` (shifting the older ones) if it is still the path's and full."""
        assert self._fd is not None and self.path is not None
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # another writer of this file waits, then reopens
        try:
            held = os.fstat(self._fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                return
            if (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev) or now.st_size < self.max_bytes:
                return  # another writer rotated it first
            if self.backups == 0:
                os.unlink(self.path)
            else:
                for i in range(self.backups - 1, 0, -1):
                    older = rotated_name(self.path, i)
                    if os.path.exists(older):
                        os.replace(older, rotated_name(self.path, i + 1))
                os.replace(self.path, rotated_name(self.path, 1))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._follow()

    def _append(self, line: bytes, events: int = 1) -> None:
        """Appends ``line`` (``events`` JSON lines) in one write; a failed one counts them all lost."""
        assert self._fd is not None
        try:
            self._follow()
        except OSError:
            pass  # the write below reports it (or lands in the file still held)
        data = b"\n" + line if self._torn else line
        try:
            written = os.write(self._fd, data)
        except OSError as e:
            written = 0
            error = e.strerror or str(e)
        else:
            error = "short write"
        if written == len(data):
            self._torn = False
            try:
                size = os.fstat(self._fd)
                if stat.S_ISREG(size.st_mode) and size.st_size >= self.max_bytes:
                    self._rotate()
            except OSError as e:
                self.rotate_failures += 1
                if self.rotate_failures & (self.rotate_failures - 1) == 0:
                    log.warning("cannot rotate %s (%s); appending to it still", self.path, e)
            return
        self._torn = self._torn or written > 0
        before = self.write_failures
        self.write_failures += events
        if before.bit_length() != self.write_failures.bit_length():  # 1st, 2nd, 4th, 8th...: not a flood
            log.warning(
                "cannot append to %s (%s): %d event(s) lost so far; the job goes on",
                self.path,
                error,
                self.write_failures,
            )

    def close(self) -> None:
        self._write_soon()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _line(event: Event) -> bytes:
    return (json.dumps(event.to_json(), default=str) + "\n").encode()


def rotated_name(path: str | os.PathLike[str], i: int) -> Path:
    """The ``i``-th rotated file of ``path`` (1: the newest)."""
    return Path(f"{os.fspath(path)}.{i}")


def rotated_files(path: str | os.PathLike[str]) -> list[Path]:
    """The rotated files of ``path`` that exist, oldest first (``.N`` ... ``.1``)."""
    p = Path(path)
    found = []
    try:
        names = os.listdir(p.parent)
    except OSError:
        return []
    prefix = p.name + "."
    for name in names:
        suffix = name[len(prefix) :] if name.startswith(prefix) else ""
        if suffix.isdigit():
            found.append((int(suffix), p.parent / name))
    return [f for _, f in sorted(found, reverse=True)]


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Reads a JSONL file (events, metrics rows) and, first, its rotated files oldest first,
    skipping a torn line (a writer killed or still writing mid-line); a file not written yet
    reads as empty."""
    for p in [*rotated_files(path), Path(path)]:
        try:
            f = open(p)
        except FileNotFoundError:
            continue
        with f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


read_events = read_jsonl


def read_typed(path: str | os.PathLike[str]) -> Iterator[Event]:
    """The events of a log as schema dataclasses; lines of unknown kinds are skipped."""
    for record in read_jsonl(path):
        event = schema.parse(record)
        if event is not None:
            yield event
