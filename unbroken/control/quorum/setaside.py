"""Setting aside a replica whose epochs keep failing: a replica that reaches the coordinator but
not its peers must not block the quorum forever.

Such a replica heartbeats, asks for quorums and is never evicted; every epoch that includes it
fails (its group's rendezvous or exchange times out), and the next epoch, formed from everyone
who asked, includes it again. Pure logic with time passed in: after ``after_failures``
consecutive failed epochs with no step committed in between, one member is set aside for a
while (its quorum requests are held, and forming does not wait for it); the members left then
train on. Which member: the one the failed epochs' own evidence blames most (the diagnosis
master's ``stall_blame``: the ends of the earliest transfer left open at both ends when a
collective was abandoned), then the one that entered the membership last (a replica coming back
from a partition is the likeliest to be cut off still), highest id on a tie, and one not tried
yet in this streak, so that a wrong guess is corrected by the next failure (the wrongly held
replica is given back at once). Without the evidence, a lossy link's host once kept training
while a healthy replica was held: the epochs without it no longer failed, so nothing corrected
the guess. The hold doubles each time
the same replica is set aside again; once it ends, the replica is admitted as a newcomer and
catches up, and if its epochs fail again it is set aside again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping


@dataclasses.dataclass
class SetAside:
    """Failure streaks and held replicas of one coordinator.

    Attributes:
        after_failures: consecutive failed epochs (no commit between them) before one member is
            set aside.
        hold_s: how long a replica is set aside the first time; doubled on each repeat.
        max_hold_s: the longest hold.
    """

    after_failures: int = 2
    hold_s: float = 10.0
    max_hold_s: float = 300.0
    streak: list[int] = dataclasses.field(default_factory=list)  # the failed epochs of this streak
    tried: set[int] = dataclasses.field(default_factory=set)
    until: dict[int, float] = dataclasses.field(default_factory=dict)  # replica -> end of its hold
    times: dict[int, int] = dataclasses.field(default_factory=dict)  # replica -> holds so far
    joined: dict[int, int] = dataclasses.field(default_factory=dict)  # replica -> epoch it entered in
    members: tuple[int, ...] = ()

    def formed(self, epoch: int, members: Iterable[int]) -> None:
        """A new epoch: remembers who entered the membership in it."""
        new, old = tuple(members), set(self.members)
        for m in new:
            if m not in old:
                self.joined[m] = epoch
        self.members = new

    def progressed(self) -> None:
        """A step was committed: the streak ends."""
        self.streak.clear()
        self.tried.clear()

    def failed(
        self,
        epoch: int,
        members: Iterable[int],
        min_replicas: int,
        now: float,
        blame: Callable[[list[int]], Mapping[int, int]] | None = None,
    ) -> int | None:
        """A member reported epoch ``epoch`` failed; returns the replica set aside now, if any.

        ``blame``: per replica, how strongly the given failed epochs' evidence points at it."""
        if epoch in self.streak:
            return None
        self.streak.append(epoch)
        if len(self.streak) < self.after_failures:
            return None
        # Epochs fail still: whoever this streak set aside was a wrong guess, and is given back.
        wrong = [r for r in self.tried if r in self.until]
        for r in wrong:
            del self.until[r]
        pool = sorted(set(members) | set(wrong))
        if len(pool) - 1 < max(1, min_replicas):
            return None
        left = [m for m in pool if m not in self.tried]
        if not left:
            self.tried.clear()
            left = pool
        counts = blame(list(self.streak)) if blame is not None else {}
        victim = max(left, key=lambda m: (counts.get(m, 0), self.joined.get(m, 0), m))
        self.tried.add(victim)
        n = self.times.get(victim, 0)
        self.times[victim] = n + 1
        self.until[victim] = now + min(self.max_hold_s, self.hold_s * 2**n)
        return victim

    def held(self, now: float) -> set[int]:
        """Replicas set aside now."""
        for r in [r for r, t in self.until.items() if t <= now]:
            del self.until[r]
        return set(self.until)
