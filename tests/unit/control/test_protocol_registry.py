"""The protocol's operations are listed once (``messages.MESSAGES``), and every side keeps to it.

Read from the source where a side's use of the protocol is spread over a module (which message
classes it builds, which it parses), from the dispatch tables where the coordinator keeps them:
an op one side sends and the other does not know, or a message built as a bare dict, fails here
rather than as a line skipped as malformed in a running job.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import unbroken
from unbroken.control import protocol
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.protocol import messages
from unbroken.control.protocol.messages import Direction, ops
from unbroken.wire.auth import JobSecret

PACKAGE = Path(unbroken.__file__).parent
COORDINATOR_SIDE = (
    "coordinator",
    "nodes/agents",
    "nodes/placement",
    "nodes/groups",
    "quorum/service",
    "protocol/serving",
    "nodes/node_relay",
)


def _uses(module: Path) -> tuple[set[str], set[str], list[int]]:
    """The message classes ``module`` builds, those it parses or matches ops against (``X.from_msg``,
    ``X.OP``), and the lines holding a dict literal with an ``"op"`` key."""
    built, read, dicts = set(), set(), []
    names = {cls.__name__ for group in messages.MESSAGES.values() for cls in group}
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            built.add(node.func.attr)
        elif isinstance(node, ast.Attribute) and node.attr in ("from_msg", "OP"):
            if isinstance(node.value, ast.Attribute) and node.value.attr in names:
                read.add(node.value.attr)
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
            dicts.append(node.lineno)
    return built, read, dicts


def _names(direction: Direction) -> set[str]:
    return {cls.__name__ for cls in messages.MESSAGES[direction]}


def test_every_message_class_names_its_op_and_the_registry_lists_each_class_once_per_direction() -> None:
    for direction, classes in messages.MESSAGES.items():
        assert len(set(classes)) == len(classes), direction
        for cls in classes:
            assert isinstance(cls.OP, str) and cls.OP, cls
            assert hasattr(cls, "to_msg"), cls
    assert ops(Direction.AGENT_TO_COORDINATOR) >= {"agent_hello", "exited", "stack", "group_port", "group_release"}


EXAMPLES = [
    protocol.Hello(replica=1, rank=2, world_size=4, transfer_addr="h:1", node="n", step=7),
    protocol.Heartbeat(step=3, compute_s=0.5),
    protocol.QuorumAsk(id=1, step=3, step_time=0.2, failed_epoch=4, failure="boom"),
    protocol.Exited(replica=2, exitcode=-9, incarnation=3),
    protocol.AgentHello(node="n", slots=2, running=(0, 1), nodes_per_replica=2, addr="10.0.0.1"),
    protocol.StackReport(replica=0, rank=1, process_state="S", stack="x", stack_note="n"),
    protocol.GroupPort(replica=1, incarnation=2, port=4000),
    protocol.GroupRelease(replica=1),
    protocol.Welcome(store="h:2", epoch=3, heartbeat_s=0.1, timeout_s=2.0),
    protocol.Abort(epoch=3),
    protocol.EpochPush(abort=3, decision={"epoch": 4, "step": 9}, transfer_addrs={"1": "h:3"}, store="h:2"),
    protocol.Donate(to=2),
    protocol.Prepare(epoch=5, member_runs=[[0, 2]], store="h:2"),
    protocol.Error("no"),
    protocol.Assign(replicas=[0, 2], num_replicas=3),
    protocol.GroupAssign(
        replica=1, incarnation=2, group_rank=1, nodes_per_replica=2, master="10.0.0.1:4000", blamed=True, num_replicas=2
    ),
    protocol.GroupStop(replica=1),
    protocol.AgentStatus(steps={"0": 5}),
    protocol.DumpStack(replica=0, rank=1),
    protocol.JobFailedNotice(reason="bad", exit_code=3),
    protocol.Alive(),
    protocol.NodeHello(node="n", ranks=(protocol.Hello(replica=1, rank=0, world_size=2, node="n", step=3),)),
    protocol.NodeHeartbeat(beats=((1, 0, 5), (1, 1, None))),
    protocol.NodeHeartbeat(beats=((1, 0, 5, 0.25), (1, 1, None, None))),
    protocol.NodeSay(says=((1, 0, {"op": "bye"}), (1, 1, {"op": "exited", "replica": 1, "exitcode": 3}))),
    protocol.NodeQuorum(asks=((1, 0, protocol.QuorumAsk(id=2, step=3, step_time=None, failed_epoch=None)),)),
    protocol.NodeLeave(ranks=((1, 1),)),
    protocol.QuorumSame(id=3, same_epoch=2, step=7),
    protocol.QuorumSame(id=3, same_epoch=2, step=7, through=9),
    protocol.NodeAnswers(to=((1, 0),), msgs=({"op": "abort", "epoch": 4},), dropped=((1, 1),)),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_what_one_side_builds_the_other_parses_back_unchanged(message: object) -> None:
    cls = type(message)
    msg = message.to_msg()  # type: ignore[attr-defined]
    assert msg["op"] == cls.OP  # type: ignore[attr-defined]
    parse = cls.from_msg  # type: ignore[attr-defined]
    parsed = parse(msg, 8) if cls is protocol.AgentHello else parse(msg)
    assert parsed == message


def test_every_message_class_with_fields_is_parsed_somewhere() -> None:
    """A message that travels with fields is validated by ``from_msg`` at its receiving edge."""
    tested = {type(m) for m in EXAMPLES}
    for classes in messages.MESSAGES.values():
        for cls in classes:
            if hasattr(cls, "from_msg"):
                assert cls in tested, f"{cls.__name__} has no round-trip example here"


def test_the_coordinator_dispatches_on_exactly_the_ops_ranks_and_agents_send(tmp_path: Path) -> None:
    c = Coordinator(CoordinatorSettings(total_replicas=2, state_dir=tmp_path), JobSecret.generate())
    try:
        assert set(c.rank_ops) | {"hello"} == ops(Direction.RANK_TO_COORDINATOR)
        assert set(c.agents.handlers) | {"agent_hello"} == ops(Direction.AGENT_TO_COORDINATOR)
        assert set(c.nodes.handlers) == ops(Direction.NODE_TO_COORDINATOR)
    finally:
        asyncio.run(c.stop())


@pytest.mark.parametrize(
    ("module", "sends", "receives"),
    [
        (PACKAGE / "control" / "client.py", Direction.RANK_TO_COORDINATOR, Direction.COORDINATOR_TO_RANK),
        (PACKAGE / "launch" / "node" / "agent.py", Direction.AGENT_TO_COORDINATOR, Direction.COORDINATOR_TO_AGENT),
    ],
    ids=["client", "agent"],
)
def test_the_rank_and_the_agent_build_and_parse_only_registered_messages(
    module: Path, sends: Direction, receives: Direction
) -> None:
    built, read, dicts = _uses(module)
    if "Hello" in read:  # the client builds its hello by parsing what it is given, as the coordinator will
        read.discard("Hello")
        built.add("Hello")
    assert not dicts, f"{module.name} builds messages as dicts at lines {dicts}: use the protocol's dataclasses"
    assert built <= _names(sends), built - _names(sends)
    assert read <= _names(receives), read - _names(receives)
    # Everything the coordinator may send this side is understood by it (ops, not classes:
    # both quorum answers share the op ``quorum``).
    assert {getattr(protocol, n).OP for n in read} == ops(receives)
    assert {getattr(protocol, n).OP for n in built} >= ops(sends) - {"exited", "status"}


def test_the_coordinator_sends_only_registered_messages() -> None:
    sent = _names(Direction.COORDINATOR_TO_RANK) | _names(Direction.COORDINATOR_TO_AGENT)
    sent |= _names(Direction.COORDINATOR_TO_NODE)
    for name in COORDINATOR_SIDE:
        built, _, dicts = _uses(PACKAGE / "control" / f"{name}.py")
        assert built <= sent, (name, built - sent)
        # the one bare dict: the answer to ``status``, the coordinator's state as it is
        assert len(dicts) == (1 if name == "coordinator" else 0), (name, dicts)


def test_the_protocol_docstring_lists_no_op_by_hand() -> None:
    """The list lives in ``messages.MESSAGES``; a second, hand-kept list drifted before."""
    doc = protocol.__doc__ or ""
    assert "MESSAGES" in doc
    listed = [op for d in Direction for op in ops(d) if f"``{op}``" in doc]
    assert not listed, listed
