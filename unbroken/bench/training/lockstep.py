"""The exchange's hold on simulated replica groups: no group starts a step before every group
was answered for the one before.

In a job, step ``k``'s exchange ends only when every member contributes to it, and a member
contributes only once it was answered for ``k``: so no member asks for ``k + 1`` while another
still waits for its answer to ``k``. The simulated groups of ``unbroken bench coordinator`` train
nothing and had no such hold. Through a takeover that was a schedule no job keeps: the groups
whose node's relay answered the step under way from a grant asked the standby for the next step
while the others still asked for that one, and the standby, continuing the epoch, rightly evicted
the first of those as replicas whose state went back (a cascade of epochs at 5,000 nodes).

Each client process keeps the lowest step answered to every group it runs that trains (a group
out of the job, the victim between its disconnect and its admission, does not count) in its slot
of a shared array; a group about to ask for ``k + 1`` waits until every slot is at ``k`` or more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

POLL_S = 0.002  # how often a waiting process reads the other processes' slots


class Lockstep:
    """One client process's side of the hold.

    Args:
        floors: a shared array with a slot per client process (``multiprocessing.Array("q")``).
        index: this process's slot.
    """

    def __init__(self, floors: Any, index: int) -> None:
        self.floors, self.index = floors, index
        self.last: dict[int, int] = {}  # group -> the newest step it was answered for
        self._at: Counter[int] = Counter()  # step -> groups whose newest answer is that step
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._poller: asyncio.Task[None] | None = None
        self._publish()

    def join(self, group: int, step: int) -> None:
        """``group`` trains, answered up to ``step`` (-1: none yet)."""
        self._drop(group)  # published once, below: the other processes never see it gone meanwhile
        self.last[group] = step
        self._at[step] += 1
        self._publish()

    def answered(self, group: int, step: int) -> None:
        """``group`` was answered for ``step`` (by the coordinator or its node's relay)."""
        old = self.last.get(group)
        if old is None or step <= old:
            return  # out of the job, or an answer to a step it was answered for
        self.join(group, step)

    def leave(self, group: int) -> None:
        """``group`` is out of the job (it left, or finished): nobody waits for it."""
        if self._drop(group):
            self._publish()

    def _drop(self, group: int) -> bool:
        old = self.last.pop(group, None)
        if old is None:
            return False
        self._at[old] -= 1
        if not self._at[old]:
            del self._at[old]
        return True

    def _publish(self) -> None:
        low = min(self._at) if self._at else 1 << 62  # a process with nobody training holds nobody back
        if self.floors[self.index] != low:
            self.floors[self.index] = low

    def floor(self) -> int:
        """The lowest step answered to every training group of every process."""
        return min(self.floors[:])

    async def reached(self, step: int, timeout: float) -> bool:
        """Waits until every group was answered for ``step`` (at most ``timeout``: a group that
        is never answered holds the others no longer than a real exchange's deadline would)."""
        if self.floor() >= step:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((step, fut))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(fut, timeout)
            return True
        return False

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(POLL_S)
            low = self.floor()
            waiting = []
            for step, fut in self._waiters:
                if fut.done():
                    continue
                if step <= low:
                    fut.set_result(None)
                else:
                    waiting.append((step, fut))
            self._waiters = waiting
