"""The coordinator's node agents: their connections, their silence, and the end of the job.

``unbroken agent`` runs on each node of a multi-node job and keeps one connection to the
coordinator (see :mod:`unbroken.launch.node.agent`). This module holds what the coordinator knows of
them: who is connected, who went silent, which agent a hung rank's stack is asked of, and when
they are all told the job is over (finished, or ended by :mod:`unbroken.control.quorum.job_health`).
Which agent runs which replica is the :class:`~unbroken.control.nodes.placement.Placement`'s: the
first agent's ``--nodes-per-replica`` picks one node per replica
(:class:`~unbroken.control.nodes.placement.NodeLaunch`) or groups across nodes
(:class:`~unbroken.control.nodes.groups.GroupLaunch`), and nothing here asks which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from unbroken.control import protocol
from unbroken.control.nodes.groups import GroupLaunch, advertised_address
from unbroken.control.nodes.placement import AgentConn, NodeLaunch, Placement, PlacementHooks
from unbroken.control.quorum.job_health import JobStop
from unbroken.observe import schema as ev


class NodeAgents:
    """The node agents of one coordinator.

    Args:
        hooks: what the placements may do to the coordinator (its ``finished`` set is shared).
        steps: the newest step of each of the given replicas that has ranks connected.
        finish_grace_s: agents are told the job is over this long after the first replica
            finished, even if a replica is still catching up (with no donor left it never can).
    """

    def __init__(
        self, hooks: PlacementHooks, steps: Callable[[list[int]], dict[str, int]], finish_grace_s: float
    ) -> None:
        self.hooks = hooks
        self.steps = steps
        self.finish_grace_s = finish_grace_s
        self.agents: dict[str, AgentConn] = {}
        self.placement: Placement = NodeLaunch(hooks)
        self.first_finish: float | None = None
        self.job_over = False  # every agent was told the job is finished
        self.handlers: dict[str, Callable[[AgentConn, protocol.Message], None]] = {
            protocol.AgentHeartbeat.OP: lambda agent, _: self.heartbeat(agent),
            protocol.Exited.OP: lambda a, m: self.placement.exited(a.node, protocol.Exited.from_msg(m)),
            protocol.GroupPort.OP: lambda a, m: self.placement.port(a.node, protocol.GroupPort.from_msg(m)),
            protocol.GroupRelease.OP: lambda a, m: self.placement.released(a.node, protocol.GroupRelease.from_msg(m)),
            protocol.StackReport.OP: lambda a, m: self.stack_report(a, protocol.StackReport.from_msg(m)),
        }

    def send(self, node: str, msg: protocol.Message) -> None:
        agent = self.agents.get(node)
        if agent is not None:
            agent.link.send(msg)

    def handle(self, agent: AgentConn, op: str, msg: protocol.Message) -> None:
        """One message from a connected agent; an op agents do not send is ignored."""
        handler = self.handlers.get(op)
        if handler is not None:
            handler(agent, msg)

    def hello(self, hello: protocol.AgentHello, link: protocol.Link) -> AgentConn | None:
        """A new agent, admitted, or refused with an error (None: its connection ends).

        Raises:
            ValueError: a multi-node agent advertising no IP address (a malformed hello).
        """
        p = self.placement
        expected = p.nodes_per_replica if p.nodes_per_replica > 1 else 1 if self.agents else hello.nodes_per_replica
        if expected != hello.nodes_per_replica:
            link.send(
                protocol.Error(
                    f"this job's agents run replica groups of {expected} node(s), not "
                    f"{hello.nodes_per_replica}: give every agent the same --nodes-per-replica"
                ).to_msg()
            )
            return None
        if hello.nodes_per_replica > 1:
            advertised_address(hello.addr)
            if p.nodes_per_replica == 1:
                self.placement = GroupLaunch(self.hooks, hello.nodes_per_replica)
        agent = AgentConn(node=hello.node, link=link, last_heartbeat=time.monotonic())
        if self.job_over:
            # An agent back after the end (cut off when the others were told, healed since): it is
            # told too, and given nothing to run. A replica placed now would train from step 0.
            link.send(protocol.JobFinished().to_msg())
            self.hooks.events.emit(ev.AgentJoined(node=agent.node, slots=hello.slots, replicas=[]))
            return agent

        def admit() -> None:
            self.agents[agent.node] = agent

        try:
            self.placement.join(hello, admit)
        except ValueError as e:
            link.send(protocol.Error(str(e)).to_msg())
            return None
        return agent

    def elsewhere(self, replica: int, node: str) -> str | None:
        """Why a connection speaking for ``node`` may not speak for ``replica``'s ranks: the
        agents' placement puts that replica on other nodes. None when it may: placed on ``node``,
        or placed nowhere yet (a restarted coordinator hears from relays before their agents,
        and a job without agents places nothing)."""
        nodes = self.placement.nodes_of(replica)
        if not nodes or node in nodes:
            return None
        return (
            f"replica {replica} is placed on node {', '.join(nodes)}, not on {node}: "
            "a node speaks only for the ranks placed on it"
        )

    def heartbeat(self, agent: AgentConn) -> None:
        agent.last_heartbeat = time.monotonic()
        steps = self.steps(self.placement.replicas_of(agent.node))
        agent.link.send(protocol.AgentStatus(steps=steps).to_msg())

    async def request_stack(self, replica: int, rank: int) -> dict[str, Any]:
        """A hung rank's stack when no supervisor runs here: its node agent is asked to dump it.

        The agent signals its own child and reads the file it computes from its own run
        directory; its answer lands in this log as a ``stack`` event.
        """
        node, rank = self.placement.stack_target(replica, rank) or (None, rank)
        agent = self.agents.get(node) if node is not None else None
        if agent is None:
            return {"stack_note": "no supervisor or agent runs this replica: no stack"}
        agent.link.send(protocol.DumpStack(replica=replica, rank=rank).to_msg())
        return {"stack_note": f"asked the agent on node {node} for the stack (a `stack` event follows)"}

    def stack_report(self, agent: AgentConn, report: protocol.StackReport) -> None:
        if not self.placement.runs(report.replica, agent.node):
            raise ValueError(f"replica {report.replica} does not run on node {agent.node}")
        self.hooks.events.emit(
            ev.Stack(
                replica=report.replica,
                rank=report.rank,
                node=agent.node,
                process_state=report.process_state,
                stack=report.stack,
                stack_note=report.stack_note,
            )
        )

    def gone(self, agent: AgentConn, cause: ev.AgentLostCause, reason: str) -> None:
        """All of the agent's replicas are gone with it: evict them now, move them to spare slots."""
        if self.agents.get(agent.node) is not agent:
            return
        del self.agents[agent.node]
        agent.link.close()
        self.placement.leave(agent.node, cause, reason)
        self.check_job_finished()

    def check_silence(self, now: float, timeout_s: float) -> None:
        """Drops every agent silent for ``timeout_s`` (a stopped agent keeps its socket open)."""
        for agent in list(self.agents.values()):
            if now - agent.last_heartbeat > timeout_s:
                self.gone(agent, ev.AgentLostCause.NO_HEARTBEAT, f"no heartbeat for {timeout_s:.1f}s")

    def replica_finished(self, replica: int) -> None:
        """Every rank of ``replica`` said bye."""
        self.hooks.finished.add(replica)
        if self.first_finish is None:
            self.first_finish = time.monotonic()
        self.check_job_finished()

    def check_job_finished(self) -> None:
        """Tells every agent the job is over once no replica that still runs is left to finish."""
        if self.job_over or not self.agents or self.first_finish is None:
            return
        finished, parked = self.hooks.finished, self.hooks.parked()
        late = time.monotonic() - self.first_finish > self.finish_grace_s
        if not late and any(r not in finished and r not in parked for r in self.placement.assigned()):
            return
        self.job_over = True
        self.hooks.events.emit(ev.JobFinished(finished=sorted(finished)))
        for agent in self.agents.values():
            agent.link.send(protocol.JobFinished().to_msg())

    def job_failed(self, stop: JobStop) -> None:
        """The job is ended: every agent stops its workers and exits with the job's code."""
        for agent in self.agents.values():
            agent.link.send(protocol.JobFailedNotice(reason=stop.reason, exit_code=stop.exit_code).to_msg())
