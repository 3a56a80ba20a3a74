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
    ) -> list[int]:
        """Registers ``node``'s agent; returns the replica ids it should run.

        Args:
            running: replicas the agent already runs: it is back after the coordinator
                restarted, and keeps them unless another agent claimed them first.
            busy: replicas whose workers are connected though no agent owns them (their agent
                has not come back yet after a restart): not handed to anyone else meanwhile.
        """
        if node in self.slots:
            raise ValueError(f"an agent for node {node!r} is already connected: give each agent its own --node")
        if slots < 1:
            raise ValueError(f"an agent needs at least one slot, got {slots}")
        self.slots[node] = slots
        kept = [r for r in sorted(set(running)) if 0 <= r < self.total_replicas and r not in self.owner][:slots]
        for r in kept:
            self.owner[r] = node
        return sorted(kept + self._fill(node, skip=busy))

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
