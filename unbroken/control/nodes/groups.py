"""The coordinator's side of replica groups that span nodes (``unbroken agent --nodes-per-replica K``).

A replica sharded over K hosts is started, stopped and restarted as one: its ranks on every
node share one rendezvous (``MASTER_ADDR:MASTER_PORT`` on the node of group rank 0), so a
group cannot lose a member and go on. Who runs what is the pure
:class:`~unbroken.control.nodes.assignment.GroupAssignment`; this shell (one of the two ways of
:mod:`unbroken.control.nodes.placement`) turns its changes into messages to the node agents:

* ``group_assign`` to the node of group rank 0 with no ``master``: it picks a free port on the
  address it advertised, starts its ranks, and answers ``group_port``; the coordinator then sends
  ``group_assign`` with ``master`` (that address and port) to the group's other nodes;
* ``group_stop`` to every node of a group that lost a member (a node, or a rank: whatever
  failed, the whole group leaves the quorum at once: its replica is evicted);
* a rank's exit restarts the group on the same nodes (its agent applies its own backoff, and
  answers ``group_release`` once its restarts are spent: a spare node then takes its place); a
  lost node is replaced by a spare node with a free slot, if there is one, and the group's
  other nodes are not blamed (no restart is counted against them).

Every start carries an ``incarnation``; an exit or a port of an older one is ignored.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from unbroken.control import protocol
from unbroken.control.nodes.assignment import GroupAssignment
from unbroken.control.nodes.placement import PlacementHooks
from unbroken.observe import schema as ev
from unbroken.observe.schema import EvictCause

MAX_NODES_PER_REPLICA = 1024


def advertised_address(addr: str) -> str:
    """The agent's ``addr``: an IP address the group's other nodes dial (its rendezvous binds it)."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"an agent of a multi-node replica group must advertise an IP address, got {addr!r}") from None
    return addr


class GroupLaunch:
    """Starts, stops and restarts the replica groups of one coordinator's node agents."""

    def __init__(self, hooks: PlacementHooks, nodes_per_replica: int) -> None:
        self.hooks = hooks
        self.assignment = GroupAssignment(hooks.total_replicas, nodes_per_replica)
        self.addrs: dict[str, str] = {}  # node -> the address it advertised
        self.blamed: dict[int, str] = {}  # replica -> the node whose rank exit restarted it last

    @property
    def nodes_per_replica(self) -> int:
        return self.assignment.nodes_per_replica

    def join(self, hello: protocol.AgentHello, admit: Callable[[], None]) -> None:
        """A new agent: may complete groups, which start at once."""
        node, addr = hello.node, hello.addr  # checked by advertised_address before the placement was picked
        if node in self.assignment.slots:
            raise ValueError(f"an agent for node {node!r} is already connected")
        admit()
        self.hooks.send(node, self.hooks.assign([]).to_msg())
        started = self.assignment.join(node, hello.slots)
        self.addrs[node] = addr
        for r in started:
            self._start(r)
        replicas = self.assignment.replicas_of(node)
        self.hooks.events.emit(ev.AgentJoined(node=node, slots=hello.slots, replicas=replicas, addr=addr))

    def leave(self, node: str, cause: ev.AgentLostCause, reason: str) -> None:
        """``node``'s agent is gone: every group it was in stops, and restarts on a spare if one is free."""
        self.hooks.events.emit(ev.AgentLost(node=node, replicas=self.replicas_of(node), cause=cause, reason=reason))
        self.addrs.pop(node, None)
        if self.hooks.job_over():  # agents leave as the job ends: nothing to restart
            self.assignment.leave(node, done=set(range(self.hooks.total_replicas)))
            return
        finished = self.hooks.finished
        hit, started = self.assignment.leave(node, done=finished)
        for r in hit:
            if r in finished:
                continue
            self._fail(r, f"its agent on node {node} is gone: {reason}", blamed=node, cause=EvictCause.AGENT_LOST)
        for r in started:
            self.hooks.events.emit("group_moved", replica=r, lost_node=node, nodes=self.assignment.nodes_of(r))
            self._start(r)

    def exited(self, node: str, exited: protocol.Exited) -> None:
        """A rank of a group on ``node`` exited: the whole group stops and starts again."""
        replica = exited.replica
        if self.assignment.group_rank(replica, node) is None:
            raise ValueError(f"replica {replica} does not run on node {node}: not its exit to report")
        if exited.incarnation != self.assignment.incarnation.get(replica):
            return  # an old start's rank, ended by our own stop
        self.blamed[replica] = node
        self._fail(replica, f"a rank on node {node} exited with code {exited.exitcode}", blamed=node)
        self.assignment.restart(replica)
        self._start(replica)

    def released(self, node: str, release: protocol.GroupRelease) -> None:
        """``node`` gave up on a group (its restart limit): another node takes its place."""
        replica = release.replica
        if self.assignment.group_rank(replica, node) is None:
            raise ValueError(f"replica {replica} does not run on node {node}")
        self._fail(replica, f"node {node} gave up on it (restart limit)", blamed=node)
        started = self.assignment.release(node, replica)
        self.hooks.send(node, protocol.GroupStop(replica=replica).to_msg())
        for r in started:
            self._start(r)

    def port(self, node: str, port: protocol.GroupPort) -> None:
        """Group rank 0 has picked its rendezvous port: the group's other nodes start their ranks."""
        replica = port.replica
        if self.assignment.group_rank(replica, node) != 0:
            raise ValueError(f"node {node} is not group rank 0 of replica {replica}")
        if port.incarnation != self.assignment.incarnation.get(replica) or not self.assignment.complete(replica):
            return
        master = f"{self.addrs[node]}:{port.port}"
        for i, other in enumerate(self.assignment.nodes_of(replica)):
            if i:
                self.hooks.send(other, self._assign(replica, i, master).to_msg())

    def runs(self, replica: int, node: str) -> bool:
        return self.assignment.group_rank(replica, node) is not None

    def nodes_of(self, replica: int) -> list[str]:
        return [n for n in self.assignment.members.get(replica, []) if n is not None]

    def replicas_of(self, node: str) -> list[int]:
        return self.assignment.replicas_of(node)

    def assigned(self) -> Iterable[int]:
        return sorted(self.assignment.members)

    def stack_target(self, replica: int, rank: int) -> tuple[str, int] | None:
        """The node that runs ``rank`` of ``replica``, and the rank's index there."""
        world = self.hooks.world_size(replica)
        nodes = self.assignment.members.get(replica, [])
        if world is None or not nodes or world % len(nodes):
            return None
        per_node = world // len(nodes)
        node = nodes[rank // per_node]
        return (node, rank % per_node) if node is not None else None

    # -- messages -------------------------------------------------------------------------

    def _assign(self, replica: int, group_rank: int, master: str) -> protocol.GroupAssign:
        return protocol.GroupAssign(
            replica=replica,
            incarnation=self.assignment.incarnation[replica],
            group_rank=group_rank,
            nodes_per_replica=self.nodes_per_replica,
            master=master,
            blamed=self.blamed.get(replica) == self.assignment.nodes_of(replica)[group_rank],
            num_replicas=self.hooks.total_replicas - self.hooks.hot_spares,
            hot_spares=self.hooks.hot_spares,
        )

    def _start(self, replica: int) -> None:
        nodes = self.assignment.nodes_of(replica)
        self.hooks.events.emit(
            "group_started", replica=replica, incarnation=self.assignment.incarnation[replica], nodes=nodes
        )
        self.hooks.send(nodes[0], self._assign(replica, 0, "").to_msg())  # it answers group_port

    def _fail(self, replica: int, reason: str, blamed: str, cause: EvictCause = EvictCause.PROCESS_EXITED) -> None:
        """The group leaves the quorum at once, and every node of it still up ends its ranks."""
        self.hooks.events.emit("group_failed", replica=replica, blamed=blamed, reason=reason)
        self.hooks.evict(replica, cause, reason)
        for n in self.assignment.nodes_of(replica):
            if n != blamed:
                self.hooks.send(n, protocol.GroupStop(replica=replica).to_msg())
