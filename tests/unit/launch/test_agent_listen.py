"""A node agent keeps listening to its coordinator after a malformed message.

The coordinator is a fake on loopback: it sends garbage, then the job's end; the agent must hear
the end and exit 0 (before, the garbage ended its listening task and it waited forever).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from unbroken.control import protocol
from unbroken.launch.agent import Agent, AgentSettings


async def _scenario(run_dir: Path) -> int:
    hellos: list[dict[str, object]] = []

    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hellos.append(json.loads(await reader.readline()))
        writer.write(b"not json\n")
        writer.write(protocol.encode({"op": "assign", "replicas": ["x"], "num_replicas": 1}))
        writer.write(protocol.encode({"op": "assign", "replicas": [], "num_replicas": 1}))
        writer.write(protocol.encode({"op": "job_finished"}))
        await writer.drain()
        await reader.read()  # until the agent hangs up

    server = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    agent = Agent(AgentSettings(command=("true",), coordinator=f"127.0.0.1:{port}", node="n0", run_dir=run_dir,
                                finish_grace_s=0.1))
    try:
        return await asyncio.wait_for(agent.run(), 20)
    finally:
        server.close()


def test_a_malformed_message_is_skipped_and_the_agent_hears_the_end_of_the_job(tmp_path: Path) -> None:
    assert asyncio.run(_scenario(tmp_path / "run")) == 0
