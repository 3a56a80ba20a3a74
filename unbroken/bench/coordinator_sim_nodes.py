"""Simulated nodes for ``unbroken bench coordinator --nodes``: a node agent speaking for its ranks.

A :class:`SimNode` is a :class:`~unbroken.bench.coordinator_sim.SimReplica` whose connection is
a node agent's (:mod:`unbroken.control.node_relay`): it says ``node_hello`` for the
``ranks_per_node`` ranks of its replica group (one group per node, as HSDP shards within a node
and replicates across nodes), asks for the quorum of all of them in one ``node_quorum`` line,
heartbeats them in one ``node_heartbeat``, and reads one ``node_answers`` line per answer burst.
The ranks share one schedule (a node's ranks finish their step together): what the
coordinator's load then scales with is the node count. Rank 0's messages stand for the node's
(every rank of it is answered in the same line).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from unbroken.bench.coordinator_sim import SimReplica
from unbroken.control import protocol
from unbroken.control.heartbeat import heartbeat_due


class SimNode(SimReplica):
    """One simulated node: its replica group's ``ranks_per_node`` ranks through one connection."""

    def _hello_msg(self) -> dict[str, Any]:
        n, node = self.plan.ranks_per_node, f"sim{self.replica}"
        ranks = tuple(
            protocol.Hello(
                replica=self.replica,
                rank=k,
                world_size=n,
                transfer_addr=f"127.0.0.1:{20000 + (self.replica * n + k) % 40000}",
                node=node,
                step=self.step,
            )
            for k in range(n)
        )
        return protocol.NodeHello(node=node, ranks=ranks).to_msg()

    def _ask_msg(self, req_id: int, step: int, failed_epoch: int | None) -> dict[str, Any]:
        ask = protocol.QuorumAsk(id=req_id, step=step, step_time=None, failed_epoch=failed_epoch)
        return protocol.NodeQuorum(asks=tuple((self.replica, k, ask) for k in range(self.plan.ranks_per_node))).to_msg()

    def _handle(self, msg: dict[str, Any]) -> None:
        if msg["op"] != protocol.NodeAnswers.OP:
            super()._handle(msg)
            return
        answers = protocol.NodeAnswers.from_msg(msg)
        if (self.replica, 0) in answers.dropped and not self.closed:
            if self._writer is not None:
                self._writer.close()
            raise ConnectionError("the coordinator dropped this node's ranks")  # reconnects, as an agent would
        for (_, rank), inner in zip(answers.to, answers.msgs, strict=True):
            if rank == 0:
                super()._handle(inner)

    async def heartbeats(self) -> None:
        """One line for the node's ranks, only when nothing else went out for a period."""
        await asyncio.sleep(random.Random(self.replica).uniform(0.0, self.heartbeat_s))
        while not self.closed:
            if heartbeat_due(time.monotonic(), self._last_sent, self.heartbeat_s):
                beats = tuple((self.replica, k, self.step) for k in range(self.plan.ranks_per_node))
                self._send(protocol.NodeHeartbeat(beats=beats).to_msg())
            await asyncio.sleep(self.heartbeat_s)
