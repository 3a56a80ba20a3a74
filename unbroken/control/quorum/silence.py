"""Whether this process went silent long enough for the coordinator to have evicted it.

A replica that was stopped (``SIGSTOP``, a frozen VM, a swap storm) past the coordinator's
silence timeout has been evicted, and its peers have formed an epoch without it and redo the
step. Yet the sum it was about to take can still complete when it resumes: the peers' abandoned
backend operations wait on in the background (up to the backend's own timeout) and pair with
its late call, with every member's contribution and the right step in the metadata. Committing
that step would count its samples twice (the peers' redo trains them too) and train a state
that its catch-up throws away. So a step during which the process was silent that long is
failed instead: the replica asks for a quorum, learns it is a newcomer, and catches up.

Two clocks are read, because either thread may run first after the process resumes: the gap
the connection thread saw between two heartbeats of one connection, and, while it has not run
yet, the age of its last heartbeat as the training thread sees it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SilenceWatch:
    """Heartbeat gaps of one client; times are ``time.monotonic()``.

    Attributes:
        limit_s: a gap longer than this counts (half the coordinator's eviction timeout, told
            in its welcome); None until told, and then nothing counts.
        last_beat: when the last heartbeat of the current connection was sent; None while
            there is no connection (a coordinator that is unreachable is not this process
            going silent: a restarted coordinator takes its replicas back).
        silent_at: when the latest gap over the limit ended.
    """

    limit_s: float | None = None
    last_beat: float | None = None
    silent_at: float | None = None

    def beat(self, now: float) -> None:
        """The connection thread's heartbeat tick at ``now`` (a tick sends no line when another
        went out within the period: :func:`unbroken.control.quorum.heartbeat.heartbeat_due`)."""
        if self.limit_s is not None and self.last_beat is not None and now - self.last_beat > self.limit_s:
            self.silent_at = now
        self.last_beat = now

    def disconnected(self) -> None:
        """The connection ended: the next one starts counting afresh."""
        self.last_beat = None

    def silent_since(self, since: float, now: float) -> bool:
        """Whether the process was silent past the limit at some time after ``since``."""
        if self.limit_s is None:
            return False
        stale = self.last_beat is not None and now - self.last_beat > self.limit_s
        return stale or (self.silent_at is not None and self.silent_at > since)
