"""The lifecycle of a replica, as the supervisor sees it (TRANSOM's TOL, made explicit).

    launching -> warming_up -> training -> failed -> recovering -> catching_up -> training
                                              \\-> isolated (no healthy slot) / stopped (given up)
    any live state -> finished (the job ended)

Only the transitions in :data:`ALLOWED` exist; each one carries a reason and becomes an event,
so a report can replay what happened to every replica and why.
"""

from __future__ import annotations

import collections
import dataclasses
import enum


class State(str, enum.Enum):
    LAUNCHING = "launching"
    WARMING_UP = "warming_up"
    TRAINING = "training"
    FAILED = "failed"
    RECOVERING = "recovering"
    CATCHING_UP = "catching_up"
    ISOLATED = "isolated"
    STOPPED = "stopped"
    FINISHED = "finished"


S = State
ALLOWED: dict[State, frozenset[State]] = {
    S.LAUNCHING: frozenset({S.WARMING_UP, S.CATCHING_UP, S.TRAINING, S.FAILED, S.FINISHED}),
    S.WARMING_UP: frozenset({S.TRAINING, S.CATCHING_UP, S.FAILED, S.FINISHED}),
    S.TRAINING: frozenset({S.FAILED, S.FINISHED}),
    S.FAILED: frozenset({S.RECOVERING, S.ISOLATED, S.STOPPED, S.FINISHED}),
    S.RECOVERING: frozenset({S.CATCHING_UP, S.TRAINING, S.FAILED, S.FINISHED}),
    S.CATCHING_UP: frozenset({S.TRAINING, S.FAILED, S.FINISHED}),
    S.ISOLATED: frozenset({S.RECOVERING, S.FINISHED, S.STOPPED}),
    S.STOPPED: frozenset(),
    S.FINISHED: frozenset(),
}
TERMINAL = frozenset({S.STOPPED, S.FINISHED})
# States in which the replica's processes run (so a process exit is a failure).
RUNNING = frozenset({S.LAUNCHING, S.WARMING_UP, S.TRAINING, S.RECOVERING, S.CATCHING_UP})


class IllegalTransition(ValueError):
    """A transition the lifecycle does not have: a supervisor bug, never a user error."""


@dataclasses.dataclass(frozen=True)
class Transition:
    replica: int
    old: State
    new: State
    reason: str
    t: float

    def to_event(self) -> dict[str, object]:
        return {"replica": self.replica, "old": self.old.value, "new": self.new.value, "reason": self.reason}


HISTORY_KEPT = 1024


class Lifecycle:
    """Per-replica states; :meth:`move` validates and records every transition."""

    def __init__(self, replicas: int, now: float = 0.0) -> None:
        self.state: dict[int, State] = {r: State.LAUNCHING for r in range(replicas)}
        self.since: dict[int, float] = {r: now for r in range(replicas)}
        # The newest transitions, for tests and the curious: every one is also an event in the
        # job's log, and a job that restarts for weeks must not keep them all in memory.
        self.history: collections.deque[Transition] = collections.deque(maxlen=HISTORY_KEPT)

    def move(self, replica: int, new: State, reason: str, now: float) -> Transition | None:
        """Moves ``replica`` to ``new``; None when it is already there (nothing to report)."""
        old = self.state[replica]
        if old == new:
            return None
        if new not in ALLOWED[old]:
            raise IllegalTransition(f"replica {replica}: {old.value} -> {new.value} ({reason}) is not a lifecycle step")
        t = Transition(replica, old, new, reason, now)
        self.state[replica] = new
        self.since[replica] = now
        self.history.append(t)
        return t

    def try_move(self, replica: int, new: State, reason: str, now: float) -> Transition | None:
        """Like :meth:`move`, but a transition that does not apply (a late event) is ignored."""
        if new not in ALLOWED[self.state[replica]]:
            return None
        return self.move(replica, new, reason, now)

    def on_quorum(self, members: list[int], behind: list[int], now: float) -> list[Transition]:
        """A new quorum: members behind are catching up, the others train."""
        out = []
        for r in members:
            if r not in self.state:
                continue
            target = State.CATCHING_UP if r in behind else State.TRAINING
            reason = "joined behind: loading the state from a donor" if r in behind else "member of the quorum"
            t = self.try_move(r, target, reason, now)
            if t is not None:
                out.append(t)
        return out

    def live(self) -> list[int]:
        return [r for r, s in self.state.items() if s not in TERMINAL]
