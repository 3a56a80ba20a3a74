"""The messages between a node agent and the coordinator: the agent's own (placement, exits,
stacks, groups) and its node's ranks through one connection (``node_*``).

See :mod:`unbroken.control.protocol.messages` for how a message is parsed and built, and the
one list of operations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from unbroken.control.protocol.fields import MAX_STACK, Message, address, count, seconds, text
from unbroken.control.protocol.rank_messages import Hello, QuorumAsk

# -- agent -> coordinator --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentHello:
    """A node agent says which node it is, how many replicas it can run and which run already."""

    OP: ClassVar[str] = "agent_hello"
    node: str
    slots: int
    running: tuple[int, ...] | None = None  # sent only when rejoining a restarted coordinator
    nodes_per_replica: int = 1  # nodes each replica group spans (every agent of a job says the same)
    addr: str = ""  # where the group's other nodes reach this one (checked when groups span nodes)

    @classmethod
    def from_msg(cls, msg: Message, max_slots: int, max_nodes_per_replica: int = 1024) -> AgentHello:
        node, slots, running = text(msg, "node"), count(msg, "slots", 1), msg.get("running", [])
        if not node or not 1 <= slots <= max_slots or not isinstance(running, list) or len(running) > max_slots:
            raise ValueError(f"an agent_hello needs a node name, 1 to {max_slots} slots and a list of running replicas")
        nodes_per_replica = count(msg, "nodes_per_replica", 1)
        if not 1 <= nodes_per_replica <= max_nodes_per_replica:
            raise ValueError(f"nodes_per_replica must be 1 to {max_nodes_per_replica}, got {nodes_per_replica}")
        return cls(
            node=node,
            slots=slots,
            running=tuple(count({"r": r}, "r") for r in running),
            nodes_per_replica=nodes_per_replica,
            addr=text(msg, "addr", 64),
        )

    def to_msg(self) -> Message:
        msg: Message = {"op": self.OP, "node": self.node, "slots": self.slots}
        if self.nodes_per_replica > 1:
            msg.update(nodes_per_replica=self.nodes_per_replica, addr=self.addr)
        if self.running is not None:
            msg["running"] = list(self.running)
        return msg


@dataclasses.dataclass(frozen=True)
class AgentHeartbeat:
    OP: ClassVar[str] = "agent_heartbeat"

    def to_msg(self) -> Message:
        return {"op": self.OP}


@dataclasses.dataclass(frozen=True)
class StackReport:
    """A node agent's answer to ``dump_stack``: the hung rank's stack, or why there is none."""

    OP: ClassVar[str] = "stack"
    replica: int
    rank: int
    process_state: str
    stack: str | None
    stack_note: str

    @classmethod
    def from_msg(cls, msg: Message) -> StackReport:
        stack = msg.get("stack")
        return cls(
            replica=count(msg, "replica"),
            rank=count(msg, "rank"),
            process_state=text(msg, "process_state", 4),
            stack=stack[-MAX_STACK:] if isinstance(stack, str) else None,
            stack_note=text(msg, "stack_note", 500),
        )

    def to_msg(self) -> Message:
        return {"op": self.OP, **dataclasses.asdict(self), "stack_note": self.stack_note[:500]}


@dataclasses.dataclass(frozen=True)
class GroupPort:
    """Group rank 0 of a replica group picked its rendezvous port."""

    OP: ClassVar[str] = "group_port"
    replica: int
    incarnation: int
    port: int

    @classmethod
    def from_msg(cls, msg: Message) -> GroupPort:
        port = count(msg, "port")
        if not 0 < port < 65536:
            raise ValueError(f"port must be 1 to 65535, got {port}")
        return cls(replica=count(msg, "replica"), incarnation=count(msg, "incarnation"), port=port)

    def to_msg(self) -> Message:
        return {"op": self.OP, "replica": self.replica, "incarnation": self.incarnation, "port": self.port}


@dataclasses.dataclass(frozen=True)
class GroupRelease:
    """A node gives up on a replica group (its restart limit): another node takes its place."""

    OP: ClassVar[str] = "group_release"
    replica: int

    @classmethod
    def from_msg(cls, msg: Message) -> GroupRelease:
        return cls(replica=count(msg, "replica"))

    def to_msg(self) -> Message:
        return {"op": self.OP, "replica": self.replica}


# -- coordinator -> agent --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Assign:
    """The replicas an agent runs; the first line an agent hears, so it carries the coordinator's
    lease term (its fencing token; None without a lease). ``num_replicas``: the replicas the job
    trains with; ``hot_spares``: how many more it runs as spares (ids from ``num_replicas`` on),
    whose workers wait for their first quorum without a bound."""

    OP: ClassVar[str] = "assign"
    replicas: list[int]
    num_replicas: int
    term: int | None = None
    hot_spares: int = 0

    @classmethod
    def from_msg(cls, msg: Message) -> Assign:
        ids, num_replicas = msg.get("replicas"), count(msg, "num_replicas")
        spares = count(msg, "hot_spares") if "hot_spares" in msg else 0
        if not isinstance(ids, list) or not all(type(r) is int and 0 <= r < num_replicas + spares for r in ids):
            raise ValueError(f"replicas must be a list of replica ids below {num_replicas + spares}")
        term = None if msg.get("term") is None else count(msg, "term")
        return cls(replicas=list(ids), num_replicas=num_replicas, term=term, hot_spares=spares)

    def to_msg(self) -> Message:
        msg: Message = {"op": self.OP, "replicas": list(self.replicas), "num_replicas": self.num_replicas}
        if self.term is not None:
            msg["term"] = self.term
        if self.hot_spares:
            msg["hot_spares"] = self.hot_spares
        return msg


@dataclasses.dataclass(frozen=True)
class GroupAssign:
    """Start this node's ranks of a replica group; ``master`` empty: pick the rendezvous port
    here (group rank 0) and answer :class:`GroupPort`. ``blamed``: the group failed here first."""

    OP: ClassVar[str] = "group_assign"
    replica: int
    incarnation: int
    group_rank: int
    nodes_per_replica: int
    master: str
    blamed: bool
    num_replicas: int
    hot_spares: int = 0

    @classmethod
    def from_msg(cls, msg: Message) -> GroupAssign:
        a = cls(
            replica=count(msg, "replica"),
            incarnation=count(msg, "incarnation"),
            group_rank=count(msg, "group_rank"),
            nodes_per_replica=count(msg, "nodes_per_replica"),
            master=text(msg, "master", 80),
            blamed=msg.get("blamed") is True,
            num_replicas=count(msg, "num_replicas"),
            hot_spares=count(msg, "hot_spares") if "hot_spares" in msg else 0,
        )
        if not a.group_rank < a.nodes_per_replica or not a.replica < a.num_replicas + a.hot_spares:
            raise ValueError(f"a group_assign for {a.nodes_per_replica} nodes per replica, group rank {a.group_rank}")
        return a

    def to_msg(self) -> Message:
        return {"op": self.OP, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class GroupStop:
    OP: ClassVar[str] = "group_stop"
    replica: int

    @classmethod
    def from_msg(cls, msg: Message) -> GroupStop:
        return cls(replica=count(msg, "replica"))

    def to_msg(self) -> Message:
        return {"op": self.OP, "replica": self.replica}


@dataclasses.dataclass(frozen=True)
class AgentStatus:
    """The steps of the replicas an agent runs (its progress watch)."""

    OP: ClassVar[str] = "agent_status"
    steps: dict[str, int]

    @classmethod
    def from_msg(cls, msg: Message) -> AgentStatus:
        steps = msg.get("steps")
        if not isinstance(steps, dict):
            raise ValueError("an agent_status without steps")
        return cls(steps={str(count({"r": int(r)}, "r")): count(steps, r) for r in steps})

    def to_msg(self) -> Message:
        return {"op": self.OP, "steps": dict(self.steps)}


@dataclasses.dataclass(frozen=True)
class DumpStack:
    OP: ClassVar[str] = "dump_stack"
    replica: int
    rank: int

    @classmethod
    def from_msg(cls, msg: Message) -> DumpStack:
        return cls(replica=count(msg, "replica"), rank=count(msg, "rank"))

    def to_msg(self) -> Message:
        return {"op": self.OP, "replica": self.replica, "rank": self.rank}


@dataclasses.dataclass(frozen=True)
class JobFinished:
    """Every replica that still runs finished (or the grace after the first finish passed)."""

    OP: ClassVar[str] = "job_finished"

    def to_msg(self) -> Message:
        return {"op": self.OP}


@dataclasses.dataclass(frozen=True)
class JobFailedNotice:
    """Coordinator -> agent: the job is ended (:mod:`unbroken.control.quorum.job_health`); stop every
    worker and exit with ``exit_code``."""

    OP: ClassVar[str] = "job_failed"
    reason: str
    exit_code: int

    def to_msg(self) -> Message:
        return {"op": self.OP, "reason": self.reason[:1000], "exit_code": self.exit_code}

    @classmethod
    def from_msg(cls, msg: Message) -> JobFailedNotice:
        code = msg.get("exit_code")
        if type(code) is not int or not 1 <= code <= 255:
            raise ValueError(f"exit_code must be an integer from 1 to 255, got {code!r:.40}")
        return cls(reason=text(msg, "reason", 1000), exit_code=code)


# -- node agent <-> coordinator: a node's ranks through one connection ------------------------

MAX_NODE_RANKS = 64  # ranks one node connection may speak for


def _pairs(msg: Message, key: str, width: int) -> list[list[Any]]:
    """``msg[key]`` as a list of at most :data:`MAX_NODE_RANKS` lists of ``width`` items."""
    value = msg.get(key, [])
    if not isinstance(value, list) or len(value) > MAX_NODE_RANKS:
        raise ValueError(f"{key} must be a list of at most {MAX_NODE_RANKS} lists of {width} items")
    for v in value:  # a loop, not all() over a generator: eight items per node line
        if type(v) is not list or len(v) != width:
            raise ValueError(f"{key} must be a list of at most {MAX_NODE_RANKS} lists of {width} items")
    return value


def _slot(replica: Any, rank: Any) -> tuple[int, int]:
    if type(replica) is int and type(rank) is int and 0 <= replica < 1 << 62 and 0 <= rank < 1 << 62:
        return replica, rank  # the common case, without count()'s dict per field (8 per node line)
    return count({"replica": replica}, "replica"), count({"rank": rank}, "rank")


@dataclasses.dataclass(frozen=True)
class NodeHello:
    """A node agent speaks for these ranks of its node (the first line of a node connection, and
    again for a rank that restarted): each as its own :class:`Hello` would say.

    ``store``: the ``HOST:PORT`` of the rendezvous store the agent hosts ("" for none): the
    cross-replica groups whose leader rank is on this node meet there, not on the
    coordinator's (:meth:`unbroken.control.quorum.service.QuorumService.rendezvous`).

    ``beforehand``: said to a standby before it takes over, on the agent's warm connection to
    it, which the standby keeps and registers when it takes over
    (:class:`unbroken.control.nodes.node_relay.PreSaid`); once it serves, a hello as any other."""

    OP: ClassVar[str] = "node_hello"
    node: str
    ranks: tuple[Hello, ...]
    store: str = ""
    beforehand: bool = False

    @classmethod
    def from_msg(cls, msg: Message) -> NodeHello:
        node, ranks, beforehand = text(msg, "node"), msg.get("ranks"), msg.get("beforehand", False)
        if not node or not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_NODE_RANKS:
            raise ValueError(f"a node_hello needs a node name and 1 to {MAX_NODE_RANKS} ranks")
        if not all(isinstance(r, dict) for r in ranks):
            raise ValueError("a node_hello's ranks are objects, as a rank's hello")
        if not isinstance(beforehand, bool):
            raise ValueError("a node_hello's beforehand is true or false")
        return cls(
            node=node,
            ranks=tuple(Hello.from_msg(r, node) for r in ranks),
            store=address(msg, "store"),
            beforehand=beforehand,
        )

    def to_msg(self) -> Message:
        msg: Message = {"op": self.OP, "node": self.node, "ranks": [h._fields() for h in self.ranks]}
        if self.store:
            msg["store"] = self.store
        if self.beforehand:
            msg["beforehand"] = True
        return msg


@dataclasses.dataclass(frozen=True)
class NodeHeartbeat:
    """The node's ranks are alive: (replica, rank, step or None) of each rank it speaks for, or
    (replica, rank, step or None, compute_s or None) where the rank reported its compute time
    (the straggler watch and ``unbroken status`` read it, as from a rank's own heartbeat)."""

    OP: ClassVar[str] = "node_heartbeat"
    beats: tuple[tuple[int, int, int | None] | tuple[int, int, int | None, float | None], ...]

    @classmethod
    def from_msg(cls, msg: Message) -> NodeHeartbeat:
        value = msg.get("beats", [])
        wide = isinstance(value, list) and any(isinstance(b, list) and len(b) == 4 for b in value)
        beats: list[tuple[int, int, int | None] | tuple[int, int, int | None, float | None]] = []
        for beat in _pairs(msg, "beats", 4 if wide else 3):
            replica, rank, step = beat[:3]
            slot = (*_slot(replica, rank), None if step is None else count({"step": step}, "step"))
            beats.append((*slot, seconds({"compute_s": beat[3]}, "compute_s", None)) if wide else slot)
        return cls(beats=tuple(beats))

    def to_msg(self) -> Message:
        return {"op": self.OP, "beats": [list(b) for b in self.beats]}


@dataclasses.dataclass(frozen=True)
class NodeQuorum:
    """The quorum requests of a node's ranks, in one line: (replica, rank, the rank's request)."""

    OP: ClassVar[str] = "node_quorum"
    asks: tuple[tuple[int, int, QuorumAsk], ...]

    @classmethod
    def from_msg(cls, msg: Message) -> NodeQuorum:
        asks = []
        last: tuple[Message, QuorumAsk] | None = None
        for replica, rank, ask in _pairs(msg, "asks", 3):
            if type(ask) is not dict:
                raise ValueError("a node_quorum's request is an object, as a rank's quorum request")
            if last is None or ask != last[0]:  # a node's ranks mostly ask the same: parsed once
                last = (ask, QuorumAsk.from_msg(ask))
            if type(replica) is int and type(rank) is int and 0 <= replica < 1 << 62 and 0 <= rank < 1 << 62:
                asks.append((replica, rank, last[1]))  # _slot's common case, without a call per rank
            else:
                asks.append((*_slot(replica, rank), last[1]))
        return cls(asks=tuple(asks))

    def to_msg(self) -> Message:
        asks: list[list[Any]] = []
        last: tuple[QuorumAsk, Message] | None = None
        for r, k, a in self.asks:
            if last is None or a != last[0]:  # a node's ranks asking alike share one dict
                last = (a, a.to_msg())
            asks.append([r, k, last[1]])
        return {"op": self.OP, "asks": asks}


@dataclasses.dataclass(frozen=True)
class NodeLeave:
    """Ranks of the node are gone (their processes exited): as their own connections closing."""

    OP: ClassVar[str] = "node_leave"
    ranks: tuple[tuple[int, int], ...]

    @classmethod
    def from_msg(cls, msg: Message) -> NodeLeave:
        return cls(ranks=tuple(_slot(r, k) for r, k in _pairs(msg, "ranks", 2)))

    def to_msg(self) -> Message:
        return {"op": self.OP, "ranks": [list(r) for r in self.ranks]}


# What a node relays for one rank, as that rank's own connection would have said it.
NODE_SAID = ("telemetry", "bye", "exited")


@dataclasses.dataclass(frozen=True)
class NodeSay:
    """What a node's ranks said besides their hello, quorum requests and heartbeats, in one line:
    (replica, rank, the rank's message), each one of :data:`NODE_SAID` (its flight-recorder
    batch, its goodbye, an exit it reports), handled as from that rank's own connection."""

    OP: ClassVar[str] = "node_say"
    says: tuple[tuple[int, int, Message], ...]

    @classmethod
    def from_msg(cls, msg: Message) -> NodeSay:
        says = []
        for replica, rank, said in _pairs(msg, "says", 3):
            if not isinstance(said, dict) or said.get("op") not in NODE_SAID:
                raise ValueError(f"a node_say carries only {', '.join(NODE_SAID)} messages of its ranks")
            says.append((*_slot(replica, rank), said))
        return cls(says=tuple(says))

    def to_msg(self) -> Message:
        return {"op": self.OP, "says": [[r, k, m] for r, k, m in self.says]}


@dataclasses.dataclass(frozen=True)
class NodeAnswers:
    """What the coordinator tells a node's ranks, in one line: ``msgs[i]`` is for rank ``to[i]``
    (the agent fans them out); ``dropped``: ranks the coordinator no longer hears through this
    node (evicted, refused: as their own connections closing; a restarted rank says hello again).
    The coordinator sends it pre-encoded (:mod:`unbroken.control.nodes.node_relay`); on the wire a
    message for several ranks in a row may be sent once, ``runs[i]`` saying for how many (the
    parsed form lists it for each, the same object)."""

    OP: ClassVar[str] = "node_answers"
    to: tuple[tuple[int, int], ...]
    msgs: tuple[Message, ...]
    dropped: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_msg(cls, msg: Message) -> NodeAnswers:
        to, msgs, runs = msg.get("to"), msg.get("msgs"), msg.get("runs")
        if not isinstance(to, list) or not isinstance(msgs, list):
            raise ValueError("a node_answers needs as many messages as ranks they are for")
        if not all(isinstance(m, dict) and isinstance(m.get("op"), str) for m in msgs):
            raise ValueError("a node_answers' messages are protocol messages")
        if runs is not None:
            if (
                not isinstance(runs, list)
                or len(runs) != len(msgs)
                or not all(type(n) is int and n >= 1 for n in runs)
                or sum(runs) != len(to)
            ):
                raise ValueError("a node_answers' runs say for how many ranks in a row each message is")
            msgs = [m for m, n in zip(msgs, runs, strict=True) for _ in range(n)]
        if len(to) != len(msgs):
            raise ValueError("a node_answers needs as many messages as ranks they are for")
        if not all(isinstance(t, list) and len(t) == 2 for t in to):
            raise ValueError("a node_answers' ranks are [replica, rank] pairs")
        dropped = tuple(_slot(r, k) for r, k in _pairs(msg, "dropped", 2))
        return cls(to=tuple(_slot(r, k) for r, k in to), msgs=tuple(msgs), dropped=dropped)

    def to_msg(self) -> Message:
        return {
            "op": self.OP,
            "to": [list(t) for t in self.to],
            "msgs": list(self.msgs),
            "dropped": [list(d) for d in self.dropped],
        }
