"""An agent that comes back after the job ended is told so and given nothing to run.

The coordinator-cut scenarios: an agent cut off when the others were told the job finished,
healed afterwards, said its hello again; it was never told, and a replica placed on it trained
from step 0 under a new epoch. Pure logic: the coordinator's agent book with recording hooks.
"""

from __future__ import annotations

from typing import Any

from unbroken.control import protocol
from unbroken.control.nodes.agents import NodeAgents
from unbroken.control.nodes.placement import PlacementHooks
from unbroken.observe import schema as ev


class Link:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


class Events:
    def __init__(self) -> None:
        self.emitted: list[Any] = []

    def emit(self, e: Any, **fields: Any) -> None:
        self.emitted.append(e)


def test_an_agent_back_after_the_end_is_told_and_runs_nothing() -> None:
    finished: set[int] = set()
    events = Events()
    book: NodeAgents

    hooks = PlacementHooks(
        total_replicas=2,
        events=events,  # type: ignore[arg-type]
        send=lambda node, msg: book.send(node, msg),
        evict=lambda replica, cause, reason: None,
        finished=finished,
        job_over=lambda: book.job_over,
        world_size=lambda: 1,
        busy=lambda: set(),
    )
    book = NodeAgents(hooks, steps=lambda replicas: {}, finish_grace_s=30.0)
    links = {n: Link() for n in ("h0", "h1")}
    for n in links:
        assert book.hello(protocol.AgentHello(node=n, slots=1), links[n]) is not None  # type: ignore[arg-type]
    assert [m["replicas"] for link in links.values() for m in link.sent if m["op"] == "assign"] == [[0], [1]]
    book.gone(book.agents["h1"], ev.AgentLostCause.NO_HEARTBEAT, "cut off")  # h1 is cut off
    book.replica_finished(0)  # replica 0 finishes; 1 has no agent: the job is over
    assert book.job_over and any(m["op"] == "job_finished" for m in links["h0"].sent)
    back = Link()
    agent = book.hello(protocol.AgentHello(node="h1", slots=1, running=(1,)), back)  # type: ignore[arg-type]
    assert agent is not None  # kept connected until it leaves, told the job is over
    assert [m["op"] for m in back.sent] == ["job_finished"]  # no assign: nothing from step 0
