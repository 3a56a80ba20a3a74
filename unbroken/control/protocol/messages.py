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

import enum
from typing import Any

from unbroken.control.protocol.agent_messages import (
    MAX_NODE_RANKS,
    NODE_SAID,
    AgentHeartbeat,
    AgentHello,
    AgentStatus,
    Assign,
    DumpStack,
    GroupAssign,
    GroupPort,
    GroupRelease,
    GroupStop,
    JobFailedNotice,
    JobFinished,
    NodeAnswers,
    NodeHeartbeat,
    NodeHello,
    NodeLeave,
    NodeQuorum,
    NodeSay,
    StackReport,
)
from unbroken.control.protocol.fields import (
    MAX_FAILURE_CHARS,
    MAX_SECONDS,
    MAX_STACK,
    Message,
    address,
    count,
    seconds,
    text,
)
from unbroken.control.protocol.rank_messages import (
    Abort,
    Alive,
    Bye,
    Donate,
    EpochPush,
    Error,
    Exited,
    Heartbeat,
    Hello,
    Prepare,
    QuorumAnswer,
    QuorumAsk,
    QuorumSame,
    StatusRequest,
    Telemetry,
    Welcome,
)

__all__ = [
    "MAX_FAILURE_CHARS",
    "MAX_NODE_RANKS",
    "MAX_SECONDS",
    "MAX_STACK",
    "MESSAGES",
    "NODE_SAID",
    "Abort",
    "AgentHeartbeat",
    "AgentHello",
    "AgentStatus",
    "Alive",
    "Assign",
    "Bye",
    "Direction",
    "Donate",
    "Prepare",
    "DumpStack",
    "EpochPush",
    "Error",
    "Exited",
    "GroupAssign",
    "GroupPort",
    "GroupRelease",
    "GroupStop",
    "Heartbeat",
    "Hello",
    "JobFailedNotice",
    "JobFinished",
    "Message",
    "NodeAnswers",
    "NodeHeartbeat",
    "NodeHello",
    "NodeLeave",
    "NodeQuorum",
    "NodeSay",
    "QuorumAnswer",
    "QuorumAsk",
    "QuorumSame",
    "StackReport",
    "StatusRequest",
    "Telemetry",
    "Welcome",
    "address",
    "count",
    "ops",
    "seconds",
    "text",
]

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
    Direction.COORDINATOR_TO_RANK: (Welcome, QuorumAnswer, QuorumSame, Abort, EpochPush, Donate, Prepare, Alive, Error),
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
