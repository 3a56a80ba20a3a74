"""Which connections a listener holds before they authenticate, and how refusals are logged.

A listener must accept a connection before it can tell a key holder from a stranger, so a
stranger who opens connections and says nothing (or drips a byte at a time) could take every
slot and shut out the job's own processes. Three rules prevent it, shared by every listener:

- connections that have not authenticated have a budget of their own (:attr:`AdmissionPolicy.max_pending`,
  and :attr:`AdmissionPolicy.max_pending_per_source` per source address), apart from the
  slots of authenticated connections, which strangers never reach;
- the newcomer wins: when the budget is full, the oldest pending connection of the source
  holding the most is closed to make room, so a flood cannot lock the door behind it; a
  connection is not shed before it has had a moment (:attr:`AdmissionPolicy.min_age_s`) to
  show its ticket, which a legitimate client sends with its connection
  (:func:`~unbroken.wire.auth.make_ticket`), so a burst of newer connections cannot push
  it out either, short of a hard cap (:attr:`AdmissionPolicy.overflow` times the budget);
- a pending connection has a short deadline (:attr:`AdmissionPolicy.deadline_s`) as a whole,
  not per read, so a drip cannot stretch it.

:class:`Admission` is the bookkeeping, pure (the caller passes the time and closes what it is
told to); :class:`RefusalLog` logs a flood's refusals once per interval, not once each.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """Bounds on a listener's connections that have not authenticated yet.

    Attributes:
        max_pending: held at once, all sources together.
        max_pending_per_source: held at once from one source address.
        deadline_s: the most a connection may take to authenticate, from its accept.
        min_age_s: a connection younger than this is not shed for a newer one: a key holder's
            ticket arrives with its connection, but the listener may read it only after a burst
            of accepts.
        overflow: over budget, younger connections are held up to this many times the budget;
            beyond, the oldest is shed whatever its age.
    """

    max_pending: int = 128
    max_pending_per_source: int = 64
    deadline_s: float = 5.0
    min_age_s: float = 0.25
    overflow: int = 4  # a listener holds at most 4 x 128 strangers (raise_descriptor_limit)

    def __post_init__(self) -> None:
        if not (1 <= self.max_pending_per_source <= self.max_pending):
            raise ValueError(
                f"admission needs 1 <= max_pending_per_source ({self.max_pending_per_source}) "
                f"<= max_pending ({self.max_pending})"
            )
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"admission's deadline_s must be a finite number > 0, got {self.deadline_s!r}")
        if not (math.isfinite(self.min_age_s) and 0 <= self.min_age_s < self.deadline_s):
            raise ValueError(f"admission's min_age_s must be >= 0 and below deadline_s, got {self.min_age_s!r}")
        if self.overflow < 1:
            raise ValueError(f"admission's overflow must be >= 1, got {self.overflow!r}")


DEFAULT_POLICY = AdmissionPolicy()


class Admission(Generic[K]):
    """The pending connections of one listener, oldest first; not thread-safe (one accept loop).

    ``K`` is whatever the listener uses to close a connection (a socket, a stream writer).
    """

    def __init__(self, policy: AdmissionPolicy = DEFAULT_POLICY) -> None:
        self.policy = policy
        self._since: OrderedDict[K, tuple[str, float]] = OrderedDict()  # oldest first
        self._by_source: dict[str, OrderedDict[K, None]] = {}
        self.admitted = self.evicted = self.expired_count = 0

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, key: object) -> bool:
        return key in self._since

    def admit(self, key: K, source: str, now: float) -> list[K]:
        """Holds ``key`` as pending; returns the older pending connections to close for it.

        Over budget, the oldest connection of the source at fault (this one if it holds its
        share, else the busiest) makes room once it has had :attr:`AdmissionPolicy.min_age_s`
        to show its ticket; while even that one is younger, the newcomer is held over budget (a
        burst must not push out a key holder whose ticket is on its way), up to
        :attr:`AdmissionPolicy.overflow` times the budget, where the oldest goes whatever its age.
        """
        if key in self._since:
            raise ValueError(f"{key!r} is pending already")
        p = self.policy
        mine = self._by_source.get(source)
        at_fault = None
        if mine is not None and len(mine) >= p.max_pending_per_source:
            at_fault = mine
        elif len(self._since) >= p.max_pending:
            at_fault = max(self._by_source.values(), key=len)  # on a tie, the source seen first
        victims: list[K] = []
        if at_fault is not None:
            oldest = next(iter(at_fault))
            if (
                now - self._since[oldest][1] >= p.min_age_s
                or len(self._since) >= p.overflow * p.max_pending
                or len(at_fault) >= p.overflow * p.max_pending_per_source
            ):
                victims.append(oldest)
        for v in victims:
            self.release(v)
        self.evicted += len(victims)
        self._since[key] = (source, now)
        self._by_source.setdefault(source, OrderedDict())[key] = None
        self.admitted += 1
        return victims

    def release(self, key: K) -> None:
        """``key`` authenticated, failed or closed: it no longer counts (no-op if not pending)."""
        held = self._since.pop(key, None)
        if held is None:
            return
        mine = self._by_source[held[0]]
        del mine[key]
        if not mine:
            del self._by_source[held[0]]

    def expired(self, now: float) -> list[K]:
        """Releases and returns the pending connections past their deadline."""
        out: list[K] = []
        for key, (_, since) in self._since.items():
            if now - since < self.policy.deadline_s:
                break  # oldest first: the rest are younger
            out.append(key)
        for key in out:
            self.release(key)
        self.expired_count += len(out)
        return out

    def oldest(self) -> K | None:
        """The connection pending longest (None when none is)."""
        return next(iter(self._since), None)

    def next_deadline(self) -> float | None:
        """When the oldest pending connection expires (None when none is pending)."""
        for _, since in self._since.values():
            return since + self.policy.deadline_s
        return None


class RefusalLog:
    """Logs a listener's refusals at most once per ``interval_s``, with how many it skipped.

    A flood of refused connections then writes a line a minute, not a line a connection.
    """

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 60.0) -> None:
        self._log, self._what, self.interval_s = logger, what, interval_s
        self._last: float | None = None
        self._skipped = 0
        self.total = 0

    def note(self, reason: str, now: float) -> bool:
        """Counts one refusal; logs it (True) unless one was logged within the interval."""
        self.total += 1
        if self._last is not None and now - self._last < self.interval_s:
            self._skipped += 1
            return False
        more = f" ({self._skipped} more since the last report)" if self._skipped else ""
        self._log.warning("%s: %s; %d in all%s", self._what, reason, self.total, more)
        self._last, self._skipped = now, 0
        return True
