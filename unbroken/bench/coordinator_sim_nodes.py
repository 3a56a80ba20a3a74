"""Simulated nodes for ``unbroken bench coordinator --nodes``: a node agent speaking for its ranks.

A :class:`SimNode` is a :class:`~unbroken.bench.coordinator_sim.SimReplica` whose connection is
a node agent's (:mod:`unbroken.control.node_relay`): it says ``node_hello`` for the
``ranks_per_node`` ranks of its replica group (one group per node, as HSDP shards within a node
and replicates across nodes), asks for the quorum of all of them in one ``node_quorum`` line,
heartbeats them in one ``node_heartbeat``, and reads one ``node_answers`` line per answer burst.
The ranks share one schedule (a node's ranks finish their step together): what the
coordinator's load then scales with is the node count. Rank 0's messages stand for the node's
(every rank of it is answered in the same line). A short answer that carries a grant
(:mod:`unbroken.control.grants`) is kept as the agent's relay keeps it, and the steps it covers
are answered here without a line, as the relay answers them (their latency is then this check
alone; the relay hop itself is measured in docs/benchmarks/2026-11-27-agent-relay.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from unbroken.bench.coordinator_sim import Answer, SimReplica
from unbroken.control import protocol
from unbroken.control.grants import Grant
from unbroken.control.heartbeat import heartbeat_due


class SimNode(SimReplica):
    """One simulated node: its replica group's ``ranks_per_node`` ranks through one connection."""

    grant: Grant | None = None

    def _hello_msg(self) -> dict[str, Any]:
        """The node's ``node_hello``, as :class:`protocol.NodeHello` writes it (the same text),
        without its eight ``Hello`` objects: a node's hello is built in the takeover's burst, on
        the cores the coordinator under test shares with the simulated nodes."""
        n, node = self.plan.ranks_per_node, f"sim{self.replica}"
        first = protocol.Hello(
            replica=self.replica, rank=0, world_size=n, node=node, step=self.step, epoch=self.epoch
        )._fields()
        base = self.replica * n
        ranks = [{**first, "rank": k, "transfer_addr": f"127.0.0.1:{20000 + (base + k) % 40000}"} for k in range(n)]
        return {"op": protocol.NodeHello.OP, "node": node, "ranks": ranks}

    def _ask_msg(self, req_id: int, step: int, failed_epoch: int | None) -> dict[str, Any]:
        ask = protocol.QuorumAsk(id=req_id, step=step, step_time=self.plan.step_time, failed_epoch=failed_epoch)
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
                op = inner["op"]
                if op == protocol.QuorumSame.OP and "decision" not in inner:
                    same = protocol.QuorumSame.from_msg(inner)
                    self.grant = Grant.from_answer(same.same_epoch, same.step, same.through)
                elif op not in (protocol.Alive.OP, protocol.Donate.OP, protocol.Error.OP):
                    self.grant = None
                super()._handle(inner)

    async def _reconnect(self) -> None:
        self.grant = None  # as the relay's: a lost node connection ends every grant (its ranks reconnect)
        await super()._reconnect()

    async def ask(self, step: int, failed_epoch: int | None = None, patience_s: float | None = None) -> None:
        grant, last = self.grant, self._last
        if not self._connected.is_set():
            grant = self.grant = None
        if grant is not None and last is not None and grant.epoch == self.epoch and grant.answers(step, failed_epoch):
            now = time.monotonic()
            self.answers.append(Answer(step, now, now, grant.epoch, len(last["decision"]["members"]), False, True))
            self._answered(step)
            return
        self.grant = None
        await super().ask(step, failed_epoch, patience_s)

    async def heartbeats(self) -> None:
        """One line for the node's ranks, only when nothing else went out for a period."""
        await asyncio.sleep(random.Random(self.replica).uniform(0.0, self.heartbeat_s))
        while not self.closed:
            if heartbeat_due(time.monotonic(), self._last_sent, self.heartbeat_s):
                beats = tuple((self.replica, k, self.step) for k in range(self.plan.ranks_per_node))
                self._send(protocol.NodeHeartbeat(beats=beats).to_msg())
            await asyncio.sleep(self.heartbeat_s)
