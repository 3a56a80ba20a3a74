"""Where node agents run replicas: one interface, two ways (one node per replica, or groups).

A job's node agents run each replica on one node (:class:`NodeLaunch`, over the pure
:class:`~unbroken.control.nodes.assignment.Assignment`), or each replica as a group of ranks spanning
several nodes (:class:`~unbroken.control.nodes.groups.GroupLaunch`, ``--nodes-per-replica K``). The
coordinator's agent bookkeeping (:mod:`unbroken.control.nodes.agents`) talks to either through
:class:`Placement` and never asks which it holds. What a placement needs of the coordinator (to
message an agent, evict a replica, the finished replicas) it is given in :class:`PlacementHooks`,
so neither imports the coordinator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

from unbroken.control import protocol
from unbroken.control.nodes.assignment import Assignment
from unbroken.observe import schema as ev
from unbroken.observe.events import EventLog


@dataclasses.dataclass
class AgentConn:
    """A node agent's connection: while it is open, the agent runs its replicas."""

    node: str
    link: protocol.Link
    last_heartbeat: float


@dataclasses.dataclass(frozen=True)
class PlacementHooks:
    """What a placement may do to the rest of the coordinator.

    Attributes:
        total_replicas: replica groups the job runs, hot spares included.
        hot_spares: how many of them are hot spares (the highest ids).
        parked: the replicas waiting, parked, for a place in an epoch (hot spares): nothing the
            job's end waits for.
        events: the coordinator's event log.
        send: sends a message to ``node``'s agent (dropped if that agent is gone).
        evict: evicts ``replica`` (cause, reason) if it is still connected or counted alive.
        finished: the replicas that finished training (a live set, read when needed).
        job_over: whether the agents were told the job is finished.
        world_size: the ranks ``replica`` announced, None while none is connected.
        busy: the replicas whose ranks are connected now.
        term: the coordinator's lease term, said in every ``assign`` (an agent leaves a
            coordinator of an older term than one it was assigned by); None without a lease.
    """

    total_replicas: int
    events: EventLog
    send: Callable[[str, protocol.Message], None]
    evict: Callable[[int, ev.EvictCause, str], None]
    finished: set[int]
    job_over: Callable[[], bool]
    world_size: Callable[[int], int | None]
    busy: Callable[[], set[int]]
    term: int | None = None
    hot_spares: int = 0
    parked: Callable[[], Collection[int]] = lambda: ()

    def assign(self, replicas: list[int]) -> protocol.Assign:
        """The ``assign`` that gives an agent ``replicas``."""
        return protocol.Assign(
            replicas=replicas,
            num_replicas=self.total_replicas - self.hot_spares,
            term=self.term,
            hot_spares=self.hot_spares,
        )


class Placement(Protocol):
    """Which agent runs which replica, and the messages that start, stop and move them."""

    @property
    def nodes_per_replica(self) -> int: ...

    def join(self, hello: protocol.AgentHello, admit: Callable[[], None]) -> None:
        """A new agent. Raises ValueError (the agent is refused, with that text) before calling
        ``admit``, which registers it; after ``admit`` the placement may message it."""

    def leave(self, node: str, cause: ev.AgentLostCause, reason: str) -> None:
        """``node``'s agent is gone, and every replica it ran with it."""

    def exited(self, node: str, exited: protocol.Exited) -> None: ...

    def port(self, node: str, port: protocol.GroupPort) -> None: ...

    def released(self, node: str, release: protocol.GroupRelease) -> None: ...

    def replicas_of(self, node: str) -> list[int]: ...

    def runs(self, replica: int, node: str) -> bool: ...

    def nodes_of(self, replica: int) -> list[str]:
        """The nodes ``replica`` is placed on (empty while it is placed nowhere)."""

    def assigned(self) -> Iterable[int]:
        """The replicas some agent runs (whose finish the job waits for)."""

    def stack_target(self, replica: int, rank: int) -> tuple[str, int] | None:
        """The node that runs ``rank`` of ``replica``, and the rank's index there."""


class NodeLaunch:
    """One node per replica: each agent runs whole replicas in its slots; spares take over."""

    nodes_per_replica = 1

    def __init__(self, hooks: PlacementHooks) -> None:
        self.hooks = hooks
        self.assignment = Assignment(hooks.total_replicas)

    def join(self, hello: protocol.AgentHello, admit: Callable[[], None]) -> None:
        node = hello.node
        replicas = self.assignment.join(
            node, hello.slots, running=list(hello.running or ()), busy=self.hooks.busy(), done=self.hooks.finished
        )
        admit()
        self.hooks.events.emit(ev.AgentJoined(node=node, slots=self.assignment.slots[node], replicas=replicas))
        self.hooks.send(
            node,
            self.hooks.assign(replicas).to_msg(),
        )

    def leave(self, node: str, cause: ev.AgentLostCause, reason: str) -> None:
        finished = self.hooks.finished
        lost, moves = self.assignment.leave(node, done=finished)
        self.hooks.events.emit(ev.AgentLost(node=node, replicas=lost, cause=cause, reason=reason))
        for r in lost:
            if r not in finished:
                self.hooks.evict(r, ev.EvictCause.AGENT_LOST, f"its agent on node {node} is gone: {reason}")
        for other, replicas in moves.items():
            for r in replicas:
                self.hooks.events.emit(ev.ReplicaReassigned(replica=r, from_node=node, to_node=other))
            self.hooks.send(
                other,
                self.hooks.assign(replicas).to_msg(),
            )

    def exited(self, node: str, exited: protocol.Exited) -> None:
        if self.assignment.owner.get(exited.replica) != node:
            raise ValueError(f"replica {exited.replica} does not run on node {node}: not its exit to report")
        self.hooks.evict(exited.replica, ev.EvictCause.PROCESS_EXITED, f"process exited with code {exited.exitcode}")

    def port(self, node: str, port: protocol.GroupPort) -> None:
        """No groups here: ignored, as any op a job of whole replicas does not use."""

    def released(self, node: str, release: protocol.GroupRelease) -> None:
        """No groups here: ignored."""

    def replicas_of(self, node: str) -> list[int]:
        return self.assignment.replicas_of(node)

    def runs(self, replica: int, node: str) -> bool:
        return self.assignment.owner.get(replica) == node

    def nodes_of(self, replica: int) -> list[str]:
        node = self.assignment.owner.get(replica)
        return [] if node is None else [node]

    def assigned(self) -> Iterable[int]:
        return self.assignment.owner

    def stack_target(self, replica: int, rank: int) -> tuple[str, int] | None:
        node = self.assignment.owner.get(replica)
        return (node, rank) if node is not None else None
