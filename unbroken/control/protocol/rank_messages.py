"""The messages between a rank and the coordinator, both ways (and ``status``).

See :mod:`unbroken.control.protocol.messages` for how a message is parsed and built, and the
one list of operations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from unbroken.control.protocol.fields import (
    MAX_FAILURE_CHARS,
    Message,
    _exitcode,
    count,
    seconds,
    text,
)

# -- rank -> coordinator ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rank says who it is (the first line of a replica's connection), and the epoch it
    trains in (the last one it was answered or pushed; None: none yet), which a coordinator
    that restarted or took over continues (:mod:`unbroken.control.quorum.resume`)."""

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
    ``incarnation``: the start of a replica group it belonged to (:mod:`unbroken.control.nodes.groups`)."""

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
    :mod:`unbroken.control.quorum.grants`): the node's relay answers them itself. A rank's own client
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
class Prepare:
    """The epoch that forms at the members' next step if nothing else changes (a newcomer is
    admitted): its members build its cross-replica group ahead
    (:meth:`unbroken.comm.cross_replica.CrossReplicaGroup.prepare`). A forecast, not a
    decision: members as ``member_runs``, checked where they are read."""

    OP: ClassVar[str] = "prepare"
    epoch: int
    member_runs: list[Any]
    store: str

    @classmethod
    def from_msg(cls, msg: Message) -> Prepare:
        runs = msg.get("member_runs")
        if not isinstance(runs, list):
            raise ValueError("a prepare message needs member_runs, a list")
        return cls(epoch=count(msg, "epoch"), member_runs=runs, store=text(msg, "store"))

    def to_msg(self) -> Message:
        return {"op": self.OP, **dataclasses.asdict(self)}


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
