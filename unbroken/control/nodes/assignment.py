"""Which node agent runs which replica: pure bookkeeping, no sockets.

A multi-node job has one agent per node, each offering a number of slots. Replica ids are
handed out lowest first as agents join; slots left over are spares. When an agent is gone (its
connection closed: the node or the agent died), its replicas are moved to agents with free
slots, and those that find none are simply not run: training continues with fewer replicas, as
long as the quorum's minimum allows.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Assignment:
    """Replica ids of one job spread over node agents."""

    total_replicas: int
    slots: dict[str, int] = dataclasses.field(default_factory=dict)
    owner: dict[int, str] = dataclasses.field(default_factory=dict)

    def join(
        self,
        node: str,
        slots: int,
        running: list[int] | tuple[int, ...] = (),
        busy: set[int] | frozenset[int] = frozenset(),
        done: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        """Registers ``node``'s agent; returns the replica ids it should run.

        Args:
            running: replicas the agent already runs: it is back after the coordinator
                restarted, and keeps them unless another agent claimed them first.
            busy: replicas whose workers are connected though no agent owns them (their agent
                has not come back yet after a restart): not handed to anyone else meanwhile.
            done: replicas that finished training: never handed out again (a finished replica
                started anew would train from step 0 without its checkpoint).
        """
        if node in self.slots:
            raise ValueError(f"an agent for node {node!r} is already connected: give each agent its own --node")
        if slots < 1:
            raise ValueError(f"an agent needs at least one slot, got {slots}")
        self.slots[node] = slots
        kept = [
            r for r in sorted(set(running)) if 0 <= r < self.total_replicas and r not in self.owner and r not in done
        ][:slots]
        for r in kept:
            self.owner[r] = node
        return sorted(kept + self._fill(node, skip=set(busy) | set(done)))

    def leave(self, node: str, done: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], dict[str, list[int]]]:
        """Drops ``node``'s agent; returns its replicas and where each moved (``{node: [ids]}``).

        Replicas in ``done`` (finished training) are dropped without moving: nothing to rejoin.
        """
        self.slots.pop(node, None)
        lost = sorted(r for r, n in self.owner.items() if n == node)
        for r in lost:
            del self.owner[r]
        movable = [r for r in lost if r not in done]
        moves: dict[str, list[int]] = {}
        for other in sorted(self.slots, key=lambda n: (-self.free(n), n)):
            if got := self._fill(other, among=movable):
                moves[other] = got
        return lost, moves

    def replicas_of(self, node: str) -> list[int]:
        return sorted(r for r, n in self.owner.items() if n == node)

    def free(self, node: str) -> int:
        return self.slots.get(node, 0) - len(self.replicas_of(node))

    def unassigned(self) -> list[int]:
        return [r for r in range(self.total_replicas) if r not in self.owner]

    def _fill(
        self, node: str, among: list[int] | None = None, skip: set[int] | frozenset[int] = frozenset()
    ) -> list[int]:
        candidates = [
            r
            for r in (among if among is not None else range(self.total_replicas))
            if r not in self.owner and r not in skip
        ]
        got = candidates[: max(0, self.free(node))]
        for r in got:
            self.owner[r] = node
        return got


@dataclasses.dataclass
class GroupAssignment:
    """Replica groups that span ``nodes_per_replica`` node agents each (FT-HSDP's shape: a
    replica sharded over several hosts).

    A replica group needs one slot on each of ``nodes_per_replica`` distinct nodes; position
    ``i`` of its member list is its ``GROUP_RANK`` ``i``. Groups are filled lowest replica id
    first, and a group with a hole (a lost node) is filled before any empty one, so a spare
    node stands in for whichever node of whichever group failed. A group runs only when every
    position is held; each start gets a new ``incarnation``, so that a late message about an
    old start (an exit, a port) is recognised and ignored.

    The group's fate is shared: any member lost stops the whole group, and only the lost node
    is replaced; the others keep their positions (they are not blamed).
    """

    total_replicas: int
    nodes_per_replica: int
    slots: dict[str, int] = dataclasses.field(default_factory=dict)
    members: dict[int, list[str | None]] = dataclasses.field(default_factory=dict)
    incarnation: dict[int, int] = dataclasses.field(default_factory=dict)
    # (node, replica) pairs a node gave up on (its restart limit): never matched again.
    refused: set[tuple[str, int]] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        if self.nodes_per_replica < 1:
            raise ValueError(f"nodes_per_replica must be >= 1, got {self.nodes_per_replica}")

    def join(self, node: str, slots: int) -> list[int]:
        """Registers ``node``'s agent; returns the replica groups that became complete (to start)."""
        if node in self.slots:
            raise ValueError(f"an agent for node {node!r} is already connected: give each agent its own --node")
        if slots < 1:
            raise ValueError(f"an agent needs at least one slot, got {slots}")
        self.slots[node] = slots
        return self._fill()

    def leave(self, node: str, done: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
        """Drops ``node``'s agent. Returns the groups it was in (every one is stopped: their
        other members must end their ranks) and the groups complete again (to start), the lost
        node replaced by a spare. Finished groups (``done``) are not refilled."""
        self.slots.pop(node, None)
        hit = [r for r, nodes in sorted(self.members.items()) if node in nodes]
        for r in hit:
            self.members[r] = [None if n == node else n for n in self.members[r]]
            self.incarnation[r] = self.incarnation.get(r, 0) + 1
        for r in done:
            if r in hit:
                del self.members[r]
        return hit, self._fill(skip=done)

    def restart(self, replica: int) -> int:
        """The group failed but all its nodes are up: it starts again on the same nodes."""
        self.incarnation[replica] = self.incarnation.get(replica, 0) + 1
        return self.incarnation[replica]

    def release(self, node: str, replica: int) -> list[int]:
        """``node`` will not run ``replica`` again (its restarts are spent): another node takes its
        position; returns the groups complete again."""
        nodes = self.members.get(replica)
        if nodes is None or node not in nodes:
            return []
        self.refused.add((node, replica))
        self.members[replica] = [None if n == node else n for n in nodes]
        self.incarnation[replica] = self.incarnation.get(replica, 0) + 1
        return self._fill()

    def complete(self, replica: int) -> bool:
        nodes = self.members.get(replica)
        return nodes is not None and None not in nodes

    def nodes_of(self, replica: int) -> list[str]:
        """The group's nodes in group-rank order (holes left out)."""
        return [n for n in self.members.get(replica, []) if n is not None]

    def group_rank(self, replica: int, node: str) -> int | None:
        nodes = self.members.get(replica, [])
        return nodes.index(node) if node in nodes else None

    def replicas_of(self, node: str) -> list[int]:
        return sorted(r for r, nodes in self.members.items() if node in nodes)

    def free(self, node: str) -> int:
        return self.slots.get(node, 0) - len(self.replicas_of(node))

    def _fill(self, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Puts nodes with free slots into holes: groups with a hole first (a replacement), then
        new groups, lowest id first. Returns the groups that became complete."""
        became = []
        order = sorted(range(self.total_replicas), key=lambda r: (r not in self.members, r))
        for r in order:
            if r in skip or self.complete(r):
                continue
            nodes = self.members.get(r) or [None] * self.nodes_per_replica
            for i, n in enumerate(nodes):
                if n is not None:
                    continue
                spare = next(
                    (
                        m
                        for m in sorted(self.slots, key=lambda m: (-self.free(m), m))
                        if self.free(m) > 0 and m not in nodes and (m, r) not in self.refused
                    ),
                    None,
                )
                if spare is None:
                    break
                nodes[i] = spare
                self.members[r] = nodes  # counted from now on by free()
            if any(n is not None for n in nodes):
                self.members[r] = nodes
            if self.complete(r):
                self.incarnation[r] = self.incarnation.get(r, 0) + 1
                became.append(r)
        return became
