"""Simulated nodes for ``unbroken bench coordinator --nodes``: a node agent speaking for its ranks.

A :class:`SimNode` is a :class:`~unbroken.bench.control_plane.coordinator_sim.SimReplica` whose connection is
a node agent's (:mod:`unbroken.control.nodes.node_relay`): it says ``node_hello`` for the
``ranks_per_node`` ranks of its replica group (one group per node, as HSDP shards within a node
and replicates across nodes), asks for the quorum of all of them in one ``node_quorum`` line,
heartbeats them in one ``node_heartbeat``, and reads one ``node_answers`` line per answer burst.
The ranks share one schedule (a node's ranks finish their step together): what the
coordinator's load then scales with is the node count. Rank 0's messages stand for the node's
(every rank of it is answered in the same line). A short answer that carries a grant
(:mod:`unbroken.control.quorum.grants`) is kept as the agent's relay keeps it, and the steps it covers
are answered here without a line, as the relay answers them (their latency is then this check
alone; the relay hop itself is measured in docs/benchmarks/2026-11-27-agent-relay.md).

As the relay, a node says its hello on its warm connection to the standby beforehand, and again a
while after its epoch changes (:data:`~unbroken.launch.node.relay.RESAY_S`); when the active
coordinator is lost it moves onto that connection without a hello, keeping its grant, and says
only the requests that wait. The standby's first line on the warm connection (its welcome, once it
took over) moves the node onto it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from unbroken.bench.control_plane.coordinator_sim import Answer, SimReplica
from unbroken.control import protocol
from unbroken.control.quorum.grants import Grant
from unbroken.control.quorum.heartbeat import heartbeat_due
from unbroken.launch.node.relay import RESAY_S, first_warm_wait


class SimNode(SimReplica):
    """One simulated node: its replica group's ``ranks_per_node`` ranks through one connection."""

    grant: Grant | None = None
    _presaid_on: asyncio.StreamWriter | None = None  # the warm connection its hello was said on
    _presaid: int | None = None  # the epoch it said there
    _resay_at: asyncio.TimerHandle | None = None
    _taken: dict[str, Any] | None = None  # the standby's first line on the warm connection
    _welcome_due = False  # moved onto the standby: its welcome counts as the node's reconnection

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

    # -- the standby, told beforehand (as unbroken.launch.node.relay) --------------------------------

    def _presay(self, writer: asyncio.StreamWriter, session: Any) -> None:
        writer.write(protocol.encode({**self._hello_msg(), "beforehand": True}, session))  # not a heartbeat's line
        self._presaid_on, self._presaid = writer, self.epoch

    async def _keep_warm(self, index: int, wait: float = 0.0) -> None:
        """The warm connection to the standby, told the node's hello; once the node moved onto it
        (:meth:`_switch`), this task goes on as its reader: no task is cancelled or started for a
        failover (at 6,250 nodes a process, the simulated nodes' own failover was the burst's
        bottleneck, not the standby)."""
        if not await self._dial_warm(index, wait):
            return
        assert self._warm is not None
        _, reader, writer, session = self._warm
        self._presay(writer, session)
        while True:
            msg = None
            with contextlib.suppress(ConnectionError, OSError, ValueError):
                line = await reader.readline()  # nothing comes before the standby takes over
                if line:
                    self.bytes_in += len(line)
                    msg = protocol.decode(line, session)
            if session is self._session:  # the node's connection now
                if msg is None:
                    break
                with contextlib.suppress(ConnectionError, ValueError):
                    self._handle(msg)
                    continue
                break
            if msg is not None and msg.get("op") == protocol.NodeAnswers.OP and self._kept():
                old = self._writer  # the standby took over, the active one hangs: move onto this one
                self._switch(msg)
                if old is not None:
                    old.close()
                continue
            if self._warm is not None and self._warm[2] is writer:
                self._warm = None
            writer.close()
            return
        self._ended(session)

    async def _read(self, reader: asyncio.StreamReader, session: Any) -> None:
        with contextlib.suppress(ConnectionError, ValueError):
            while line := await reader.readline():
                self.bytes_in += len(line)
                self._handle(protocol.decode(line, session))
        self._ended(session)

    def _ended(self, session: Any) -> None:
        """A connection ended: the node's own (not one it moved off already) fails over or reconnects."""
        if session is not self._session or self.closed:
            return
        if self._kept():
            self._switch()
            return
        self.grant = None  # as the relay's: a node connection lost without a standby told ends every grant
        if not self._connected.is_set():
            self._address += 1  # ended before its welcome: the next address (see SimReplica._read)
        self._connected.clear()
        asyncio.get_running_loop().create_task(self._reconnect())

    def _kept(self) -> bool:
        warm = self._warm
        return warm is not None and not warm[2].is_closing() and warm[2] is self._presaid_on

    def _switch(self, taken: dict[str, Any] | None = None) -> None:
        """Moves onto the warm connection, as the relay (no hello: the standby was told it), its last
        answer and its grant standing; says what it waits for."""
        warm, self._warm, self._warming = self._warm, None, None  # that task reads this connection from now
        assert warm is not None
        self._address, _, writer, session = warm
        self._writer, self._session = writer, session
        if self._presaid != self.epoch:  # changed since it was said: said again, in full
            self._send({**self._hello_msg(), "beforehand": True})
        for req_id, (step, _, failed, _) in list(self._pending.items()):
            self._send(self._ask_msg(req_id, step, self.epoch if failed else None))
        self._connected.set()
        self._welcome_due = True
        if taken is not None:
            self._handle(taken)
        n = len(self.plan.addresses)
        if self.plan.warm and n > 1:
            self._warm_up((self._address + 1) % n, first_warm_wait(True))

    def _resay(self) -> None:
        """Says the node's hello to the standby again, a while after its epoch changed (as the relay)."""
        self._resay_at = None
        warm = self._warm
        if warm is not None and warm[2] is self._presaid_on and self._presaid != self.epoch:
            self._presay(warm[2], warm[3])

    def _mind_standby(self) -> None:
        warm = self._warm
        if self._resay_at is None and warm is not None and warm[2] is self._presaid_on and self._presaid != self.epoch:
            self._resay_at = asyncio.get_running_loop().call_later(random.uniform(*RESAY_S), self._resay)

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
                if op == protocol.Welcome.OP and self._welcome_due:
                    self._welcome_due = False
                    self.connects.append(time.monotonic())
                if op == protocol.QuorumSame.OP and "decision" not in inner:
                    same = protocol.QuorumSame.from_msg(inner)
                    self.grant = Grant.from_answer(same.same_epoch, same.step, same.through)
                elif op not in (protocol.Alive.OP, protocol.Donate.OP, protocol.Prepare.OP, protocol.Error.OP):
                    self.grant = None
                super()._handle(inner)
                self._mind_standby()

    async def ask(self, step: int, failed_epoch: int | None = None, patience_s: float | None = None) -> None:
        grant, last = self.grant, self._last
        if not self._connected.is_set() and not self._kept():
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
