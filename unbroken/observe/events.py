"""Structured events: what happened, to whom, when, and why.

Every component writes events through an :class:`EventLog`; they land as JSON lines in the run
directory so a person (or the report) can read afterwards what broke and what was done.

Each event is a dataclass of :mod:`unbroken.observe.schema`; the log stamps it with its source,
writes its JSON line and hands the typed event to the subscribers.

Writing an event is never worth more than the work it records: a full disk or a failing
subscriber is logged and counted, and the caller (the coordinator's timer, a connection, the
supervisor) goes on. Losing a line of history is a nuisance; a coordinator that stops evicting
dead replicas stalls the whole job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unbroken.observe import schema
from unbroken.observe.schema import Event

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path`` (JSONL) and hands each to the subscribers.

    Args:
        path: the JSONL file; None keeps events in memory only.
        source: who writes (``coordinator``, ``launcher``, ``replica-2``...).

    Attributes:
        write_failures: events that could not be appended to ``path`` (disk full, I/O error).
        subscriber_failures: subscriber calls that raised.
    """

    def __init__(self, path: str | os.PathLike[str] | None, source: str) -> None:
        self.source = source
        self.path = None if path is None else Path(path)
        self.write_failures = 0
        self.subscriber_failures = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # the last append failed part-way: the next one starts a fresh line
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One O_APPEND write per event: nothing is left in a user-space buffer after a failed
            # write to be flushed, out of place, with a later event.
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._subscribers: list[Callable[[Event], None]] = []

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
        if not event.source:
            event = dataclasses.replace(event, source=self.source)
        with self._lock:
            if self._fd is not None:
                self._append((json.dumps(event.to_json(), default=str) + "\n").encode())
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception:
                self.subscriber_failures += 1
                log.exception("an event subscriber failed on %r; the event is dropped for it", event.KIND)
        return event

    def _append(self, line: bytes) -> None:
        assert self._fd is not None
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
            return
        self._torn = self._torn or written > 0
        self.write_failures += 1
        if self.write_failures & (self.write_failures - 1) == 0:  # 1st, 2nd, 4th, 8th...: not a flood
            log.warning(
                "cannot append to %s (%s): %d event(s) lost so far; the job goes on",
                self.path,
                error,
                self.write_failures,
            )

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Reads a JSONL file (events, metrics rows), skipping a torn line (a writer killed or
    still writing mid-line); a file not written yet reads as empty."""
    p = Path(path)
    if not p.exists():
        return
    with open(p) as f:
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
