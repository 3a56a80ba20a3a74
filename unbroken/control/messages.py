"""Every message of the coordinator's protocol, typed, and the one list of its operations.

What a peer sends is parsed once, at the receiving edge, into one of the frozen dataclasses
below (``from_msg``): every field validated by :func:`count`, :func:`seconds` and :func:`text`
(types, bounds, lengths), so the handlers past the edge work with named, typed fields and never
with the raw dict. The job-relative checks (a replica id below the job's count, a rank below
its world size) stay with the coordinator, which knows the job. What a side sends is built from
the same dataclasses (``to_msg``), so both sides of a line are spelt in one place: the
coordinator, the rank's :class:`~unbroken.control.client.CoordinatorClient` and the node agent.

:data:`MESSAGES` is the list of operations, by direction: the module docstrings point here
instead of listing them, and a unit test checks every op sent or dispatched on against it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, ClassVar

from unbroken.config import parse_host_port
from unbroken.control.failure import MAX_FAILURE_CHARS

Message = dict[str, Any]

MAX_SECONDS = 86400.0  # no duration the job reports (a step, a compute time) is longer than a day
MAX_STACK = 8000  # characters of a stack kept in an event


def count(msg: Message, key: str, default: int | None = None) -> int:
    """``msg[key]`` as a non-negative integer (a step, an id, an epoch); ValueError otherwise."""
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r:.40}")
    return value


def seconds(msg: Message, key: str, default: float | None) -> float | None:
    """``msg[key]`` as a duration of 0 to :data:`MAX_SECONDS`, or None; ValueError otherwise.

    Bounded, not merely finite: a step time of 1e308 would stretch the join window forever.
    """
    value = msg.get(key, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= MAX_SECONDS
    ):
        raise ValueError(f"{key} must be a number of seconds from 0 to {MAX_SECONDS:g}, got {value!r:.40}")
    return float(value)


def text(msg: Message, key: str, max_len: int = 256) -> str:
    """``msg[key]`` as a string of at most ``max_len`` characters ("" when absent); ValueError otherwise."""
    value = msg.get(key, "")
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{key} must be a string of at most {max_len} characters, got {value!r:.40}")
    return value


def address(msg: Message, key: str) -> str:
    """``msg[key]`` as ``HOST:PORT`` (:func:`unbroken.config.parse_host_port`), or "" when absent;
    ValueError otherwise."""
    value = text(msg, key)
    if value:
        parse_host_port(value, key)
    return value


def _exitcode(msg: Message) -> int | None:
    code = msg.get("exitcode")
    if code is not None and (type(code) is not int or not -256 <= code <= 255):
        raise ValueError(f"exitcode must be an integer from -256 to 255, got {code!r:.40}")
    return code


# -- rank -> coordinator ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rank says who it is (the first line of a replica's connection), and the epoch it
    trains in (the last one it was answered or pushed; None: none yet), which a coordinator
    that restarted or took over continues (:mod:`unbroken.control.resume`)."""

    OP: ClassVar[str] = "hello"
    replica: int
    rank: int
    world_size: int
    transfer_addr: str = ""
    node: str = ""
    step: int = 0
    epoch: int | None = None

    @classmethod
    def from_msg(cls, msg: Message, node: str | None = None) -> Hello:
        """``node``: the node it runs on, as its agent said it (its own ``node`` is not read)."""
        return cls(
            replica=count(msg, "replica"),
            rank=count(msg, "rank"),
            world_size=count(msg, "world_size"),
            transfer_addr=text(msg, "transfer_addr"),
            node=text(msg, "node") if node is None else node,
            step=count(msg, "step", 0),
            epoch=None if msg.get("epoch") is None else count(msg, "epoch"),
        )

    def to_msg(self) -> Message:
        msg = self._fields()
        msg["node"] = self.node
        return {"op": self.OP, **msg}

    def _fields(self) -> Message:
        """Its fields but the node, as a node's hello lists them (no ``dataclasses.asdict``: its
        deep copy made a node's hello 190 us, 12,500 of them in a takeover's burst)."""
        msg: Message = {
            "replica": self.replica,
            "rank": self.rank,
            "world_size": self.world_size,
            "transfer_addr": self.transfer_addr,
            "step": self.step,
        }
        if self.epoch is not None:  # left out when none, as before there was one: an older coordinator reads it
            msg["epoch"] = self.epoch
        return msg


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A rank is alive; its step and compute time, when it sends them."""

    OP: ClassVar[str] = "heartbeat"
    step: int | None
    compute_s: float | None

    @classmethod
    def from_msg(cls, msg: Message) -> Heartbeat:
        step = None if msg.get("step") is None else count(msg, "step")
        return cls(step=step, compute_s=seconds(msg, "compute_s", None))

    def to_msg(self) -> Message:
        return {"op": self.OP, "step": self.step, "compute_s": self.compute_s}


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """A heartbeat carrying the rank's flight-recorder batch (parsed by the diagnosis master)."""

    OP: ClassVar[str] = "telemetry"
    beat: Heartbeat
    batch: Message

    def to_msg(self) -> Message:
        return {"op": self.OP, "step": self.beat.step, "compute_s": self.beat.compute_s, **self.batch}


@dataclasses.dataclass(frozen=True)
class QuorumAsk:
    """A rank's quorum request for ``step`` (``failed_epoch``: its exchange in that epoch failed,
    ``failure``: with this error, which the coordinator classifies itself)."""

    OP: ClassVar[str] = "quorum"
    id: int
    step: int
    step_time: float | None
    failed_epoch: int | None
    failure: str | None = None

    @classmethod
    def from_msg(cls, msg: Message) -> QuorumAsk:
        failed = None if msg.get("failed_epoch") is None else count(msg, "failed_epoch")
        failure = msg.get("failure")
        if failure is not None and (not isinstance(failure, str) or len(failure) > MAX_FAILURE_CHARS):
            raise ValueError(f"failure must be a string of at most {MAX_FAILURE_CHARS} characters")
        return cls(
            id=count(msg, "id"),
            step=count(msg, "step"),
            step_time=seconds(msg, "step_time", None),
            failed_epoch=failed,
            failure=failure if failed is not None else None,
        )

    def to_msg(self) -> Message:
        # A field that is None is left out, as from_msg reads it: no ``null`` in the text, which
        # jsontext.dumps would have to search the message for a NaN written as null.
        msg: Message = {"op": self.OP, "id": self.id, "step": self.step}
        if self.failed_epoch is not None:
            msg["failed_epoch"] = self.failed_epoch
            if self.failure is not None:
                msg["failure"] = self.failure[:MAX_FAILURE_CHARS]
        if self.step_time is not None:
            msg["step_time"] = self.step_time
        return msg


@dataclasses.dataclass(frozen=True)
class Bye:
    """A rank finished training (a finished replica is not a failed one)."""

    OP: ClassVar[str] = "bye"

    def to_msg(self) -> Message:
        return {"op": self.OP}


@dataclasses.dataclass(frozen=True)
class Exited:
    """A process of ``replica`` exited (reported by its supervisor, agent, or a sibling rank);
    ``incarnation``: the start of a replica group it belonged to (:mod:`unbroken.control.groups`)."""

    OP: ClassVar[str] = "exited"
    replica: int
    exitcode: int | None
    incarnation: int = 0

    @classmethod
    def from_msg(cls, msg: Message) -> Exited:
        return cls(replica=count(msg, "replica"), exitcode=_exitcode(msg), incarnation=count(msg, "incarnation", 0))

    def to_msg(self) -> Message:
        return {"op": self.OP, "replica": self.replica, "exitcode": self.exitcode, "incarnation": self.incarnation}


@dataclasses.dataclass(frozen=True)
class StatusRequest:
    """``unbroken status``: the coordinator answers with :meth:`Coordinator.status`."""

    OP: ClassVar[str] = "status"

    def to_msg(self) -> Message:
        return {"op": self.OP}


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


# -- coordinator -> rank ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Welcome:
    OP: ClassVar[str] = "welcome"
    store: str
    epoch: int
    heartbeat_s: float | None  # the period the rank must heartbeat at (it grows with the job's size)
    timeout_s: float | None  # silence after which the coordinator evicts a replica
    # The coordinator's lease term (its fencing token; None: a coordinator without a lease, inside
    # `unbroken run`). Every line on the connection is that term's: a client that saw a higher
    # term drops the connection, so no answer of a replaced coordinator is taken after a newer one.
    term: int | None = None

    @classmethod
    def from_msg(cls, msg: Message) -> Welcome:
        if not isinstance(msg.get("store"), str):
            raise ValueError("a welcome without a store address")
        return cls(
            store=msg["store"],
            epoch=count(msg, "epoch", 0),
            heartbeat_s=seconds(msg, "heartbeat_s", None),
            timeout_s=seconds(msg, "timeout_s", None),
            term=None if msg.get("term") is None else count(msg, "term"),
        )

    def to_msg(self) -> Message:
        msg: Message = {
            "op": self.OP,
            "store": self.store,
            "epoch": self.epoch,
            "heartbeat_s": self.heartbeat_s,
            "timeout_s": self.timeout_s,
        }
        if self.term is not None:
            msg["term"] = self.term
        return msg


@dataclasses.dataclass(frozen=True)
class QuorumAnswer:
    """A full quorum answer's fields; the coordinator sends it pre-encoded
    (:func:`~unbroken.control.protocol.answer_tail`), with ``transfer_addrs`` holding only a
    behind replica's donor (nobody else fetches)."""

    OP: ClassVar[str] = "quorum"
    id: int
    decision: dict[str, Any]
    transfer_addrs: dict[str, str]
    store: str

    def to_msg(self) -> Message:
        return {"op": self.OP, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class QuorumSame:
    """The fast path's answer: the epoch this connection holds, now at ``step``, nobody behind.

    ``through``: the same answer stands for the steps up to this one (a grant,
    :mod:`unbroken.control.grants`): the node's relay answers them itself. A rank's own client
    reads no further than ``step``.
    """

    OP: ClassVar[str] = "quorum"
    id: int
    same_epoch: int
    step: int
    through: int | None = None

    @classmethod
    def from_msg(cls, msg: Message) -> QuorumSame:
        """Raises ValueError unless it is a short answer (a full one has a ``decision``)."""
        if "decision" in msg:
            raise ValueError("a full quorum answer, not a short one")
        step = count(msg, "step")
        through = msg.get("through")
        return cls(
            id=count(msg, "id"),
            same_epoch=count(msg, "same_epoch"),
            step=step,
            through=None if through is None else max(step, count(msg, "through")),
        )

    def to_msg(self) -> Message:
        msg: Message = {"op": self.OP, "id": self.id, "same_epoch": self.same_epoch, "step": self.step}
        if self.through is not None and self.through > self.step:
            msg["through"] = self.through
        return msg


@dataclasses.dataclass(frozen=True)
class Abort:
    OP: ClassVar[str] = "abort"
    epoch: int

    @classmethod
    def from_msg(cls, msg: Message) -> Abort:
        return cls(epoch=count(msg, "epoch"))

    def to_msg(self) -> Message:
        return {"op": self.OP, "epoch": self.epoch}


@dataclasses.dataclass(frozen=True)
class EpochPush:
    """The next epoch, formed at an eviction and pushed with the abort of the broken one
    (``abort``): the full answer a member's re-ask would have got, without a request id. The
    coordinator sends it pre-encoded (:func:`~unbroken.control.protocol.push_payload`)."""

    OP: ClassVar[str] = "epoch"
    abort: int
    decision: dict[str, Any]
    transfer_addrs: dict[str, str]
    store: str

    @classmethod
    def from_msg(cls, msg: Message) -> EpochPush:
        decision, addrs = msg.get("decision"), msg.get("transfer_addrs", {})
        if not isinstance(decision, dict) or not isinstance(addrs, dict):
            raise ValueError("an epoch push needs a decision and transfer_addrs objects")
        return cls(abort=count(msg, "abort"), decision=decision, transfer_addrs=addrs, store=text(msg, "store"))

    def to_msg(self) -> Message:
        return {"op": self.OP, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Donate:
    OP: ClassVar[str] = "donate"
    to: int

    @classmethod
    def from_msg(cls, msg: Message) -> Donate:
        return cls(to=count(msg, "to"))

    def to_msg(self) -> Message:
        return {"op": self.OP, "to": self.to}


@dataclasses.dataclass(frozen=True)
class Alive:
    """To a rank whose request waits: the coordinator is alive and holds its lease (a rank
    that hears nothing for long tries the standby)."""

    OP: ClassVar[str] = "alive"

    @classmethod
    def from_msg(cls, msg: Message) -> Alive:
        return cls()

    def to_msg(self) -> Message:
        return {"op": self.OP}


@dataclasses.dataclass(frozen=True)
class Error:
    OP: ClassVar[str] = "error"
    message: str

    @classmethod
    def from_msg(cls, msg: Message) -> Error:
        return cls(message=str(msg.get("message"))[:500])

    def to_msg(self) -> Message:
        return {"op": self.OP, "message": self.message[:500]}


# -- coordinator -> agent --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Assign:
    OP: ClassVar[str] = "assign"
    replicas: list[int]
    num_replicas: int

    @classmethod
    def from_msg(cls, msg: Message) -> Assign:
        ids, num_replicas = msg.get("replicas"), count(msg, "num_replicas")
        if not isinstance(ids, list) or not all(type(r) is int and 0 <= r < num_replicas for r in ids):
            raise ValueError(f"replicas must be a list of replica ids below {num_replicas}")
        return cls(replicas=list(ids), num_replicas=num_replicas)

    def to_msg(self) -> Message:
        return {"op": self.OP, "replicas": list(self.replicas), "num_replicas": self.num_replicas}


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
        )
        if not a.group_rank < a.nodes_per_replica or not a.replica < a.num_replicas:
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
    """Coordinator -> agent: the job is ended (:mod:`unbroken.control.job_health`); stop every
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
    coordinator's (:meth:`unbroken.control.quorum_service.QuorumService.rendezvous`).

    ``beforehand``: said to a standby before it takes over, on the agent's warm connection to
    it, which the standby keeps and registers when it takes over
    (:class:`unbroken.control.node_relay.PreSaid`); once it serves, a hello as any other."""

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
    The coordinator sends it pre-encoded (:mod:`unbroken.control.node_relay`); on the wire a
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


# -- the list of operations ------------------------------------------------------------------


class Direction(enum.Enum):
    RANK_TO_COORDINATOR = "rank -> coordinator"
    COORDINATOR_TO_RANK = "coordinator -> rank"
    AGENT_TO_COORDINATOR = "agent -> coordinator"
    COORDINATOR_TO_AGENT = "coordinator -> agent"
    STATUS = "status client -> coordinator"
    NODE_TO_COORDINATOR = "node agent (for its ranks) -> coordinator"
    COORDINATOR_TO_NODE = "coordinator -> node agent (for its ranks)"


MESSAGES: dict[Direction, tuple[type[Any], ...]] = {
    Direction.RANK_TO_COORDINATOR: (Hello, Heartbeat, Telemetry, QuorumAsk, Bye, Exited),
    # ``quorum``: a full answer (sent pre-encoded) or the fast path's short one.
    Direction.COORDINATOR_TO_RANK: (Welcome, QuorumAnswer, QuorumSame, Abort, EpochPush, Donate, Alive, Error),
    Direction.AGENT_TO_COORDINATOR: (AgentHello, AgentHeartbeat, Exited, StackReport, GroupPort, GroupRelease),
    Direction.COORDINATOR_TO_AGENT: (
        Assign,
        GroupAssign,
        GroupStop,
        AgentStatus,
        DumpStack,
        JobFinished,
        JobFailedNotice,
        Error,
    ),
    Direction.STATUS: (StatusRequest,),
    # A node's ranks through one connection: what each rank would say and hear, aggregated.
    Direction.NODE_TO_COORDINATOR: (NodeHello, NodeHeartbeat, NodeQuorum, NodeSay, NodeLeave),
    Direction.COORDINATOR_TO_NODE: (NodeAnswers,),  # answered with a ``status`` line of the coordinator's state
}


def ops(direction: Direction) -> frozenset[str]:
    """The operation names that travel in ``direction``."""
    return frozenset(cls.OP for cls in MESSAGES[direction])
