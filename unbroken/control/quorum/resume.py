"""Continuing the job's epoch when a coordinator restarts or a standby takes over.

A coordinator that starts on a state directory with history used to form a first epoch of its
own: every replica waited for every other to ask again (the startup window), then rebuilt its
cross-replica group for the new epoch, for a membership that nothing had changed (at 12,500
nodes, 5 s from the kill to the standby's first epoch: docs/benchmarks/2026-11-27-takeover-answers.md).
Instead it continues the last epoch in its history: a rank says in its hello the epoch it trains
in (:class:`~unbroken.control.protocol.messages.Hello`), and a member saying that one is answered in it as
soon as its ranks ask, as the previous coordinator would have answered it. Nobody waits for the
others and no group is rebuilt.

The history may be behind: an epoch's number is reserved on disk before it is handed out, but
its members are written after (:class:`~unbroken.control.state.state_store.StateStore`). So the epoch
continues only while every member that comes back says it. A member saying another epoch (a
newer one that was handed out and not written; an older one or none: a process that restarted,
which holds no group of it) gives it up: the ranks answered in it are told to abort its exchange,
and the next epoch forms as a first one, as it did before this module. A member that has not come
back within the window is evicted as silent, and the epoch pushed without it, as after any death.

:class:`ResumedEpoch` is the rule, pure; :class:`EpochResume` is the coordinator's side of it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence

from unbroken.control import protocol
from unbroken.control.quorum.rules import QuorumDecision, QuorumState
from unbroken.control.quorum.service import RankConn
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog


class Claim(enum.Enum):
    """What a rank's hello says of the resumed epoch."""

    MEMBER = "member"  # a member training in it: answered in it
    NEWCOMER = "newcomer"  # not a member of it: admitted at a next step, as any newcomer
    CONFLICT = "conflict"  # a member training in another epoch, or a newer epoch exists: given up


@dataclasses.dataclass
class ResumedEpoch:
    """The epoch continued, and which of its members are back.

    Attributes:
        decision: the last epoch in the history.
        until: when members not back are given up on (``time.monotonic()``).
        back: members whose every rank said hello.
    """

    decision: QuorumDecision
    until: float
    back: set[int] = dataclasses.field(default_factory=set)

    def claim(self, replica: int, said: int | None) -> Claim:
        """What the hello of a rank of ``replica`` saying it trains in epoch ``said`` means."""
        d = self.decision
        if said is not None and said > d.epoch:
            return Claim.CONFLICT  # handed out after the history was last written
        if replica not in d.member_set:
            return Claim.NEWCOMER
        return Claim.MEMBER if said == d.epoch else Claim.CONFLICT

    def overdue(self, now: float) -> list[int]:
        """The members not back once the window is over (none before)."""
        if now < self.until:
            return []
        return [m for m in self.decision.members if m not in self.back]

    @property
    def complete(self) -> bool:
        return len(self.back) == len(self.decision.members)


class EpochResume:
    """A coordinator's continuation of ``decision`` (built when it starts), until every member is
    back, the window ends, or a member says another epoch (:attr:`done` then).

    Args:
        decision: the last epoch in the history.
        quorum: the coordinator's quorum state, which continues ``decision`` from here.
        replicas: the coordinator's connected ranks by replica (read, and told to abort).
        events: the coordinator's event log.
        evict: evicts a replica (cause, reason): a member not back in time.
        window_s: how long members have to come back.
    """

    def __init__(
        self,
        decision: QuorumDecision,
        quorum: QuorumState,
        replicas: dict[int, dict[int, RankConn]],
        events: EventLog,
        evict: Callable[[int, ev.EvictCause, str], None],
        window_s: float,
    ) -> None:
        self.quorum, self.replicas, self.events, self.evict = quorum, replicas, events, evict
        self.window_s = window_s
        self.state = ResumedEpoch(decision, time.monotonic() + window_s)
        self.done = False
        quorum.resume(decision)
        events.emit(
            ev.EpochResumed(epoch=decision.epoch, step=decision.step, members=list(decision.members), window_s=window_s)
        )

    def _continues(self) -> bool:
        cur = self.quorum.current
        return cur is not None and cur.epoch == self.state.decision.epoch

    def hello(self, conns: Sequence[RankConn], said: int | None, complete: bool) -> None:
        """``conns``, ranks of one replica, said hello saying they train in epoch ``said``;
        ``complete``: every rank of their replica is connected now."""
        replica = conns[0].replica
        if self._continues():  # once this coordinator formed an epoch of its own, a claim is moot
            claim = self.state.claim(replica, said)
            if claim is Claim.CONFLICT:
                self._give_up(replica, said)
                return
            if claim is Claim.MEMBER:
                for conn in conns:
                    conn.trains = self.state.decision.epoch
        if complete:
            self.state.back.add(replica)
            self.done = self.state.complete

    def tick(self, now: float) -> None:
        """Evicts the members not back once the window is over; then it is done."""
        if now < self.state.until:
            return
        self.done = True
        for replica in self.state.overdue(now):
            self.evict(
                replica,
                ev.EvictCause.NO_HEARTBEAT,
                f"not back within {self.window_s:.1f}s of the coordinator's start (it resumed epoch "
                f"{self.state.decision.epoch})",
            )

    def _give_up(self, replica: int, said: int | None) -> None:
        epoch = self.state.decision.epoch
        self.done = True
        self.events.emit(ev.ResumeGivenUp(epoch=epoch, replica=replica, said=said))
        connected = set()
        for r, ranks in self.replicas.items():
            for conn in ranks.values():
                conn.trains = None
                if conn.epoch == epoch:  # answered in it: in an exchange that may never complete
                    conn.link.send(protocol.Abort(epoch=epoch).to_msg())
            first = next(iter(ranks.values()), None)
            if first is not None and len(ranks) == first.world_size:
                connected.add(r)
        self.quorum.abandon(connected, time.monotonic())
