"""A node agent keeps listening to its coordinator after a malformed message, and hears only
the job's coordinator.

The coordinator is a fake on loopback: it sends garbage, then the job's end; the agent must hear
the end and exit 0 (before, the garbage ended its listening task and it waited forever). An
impostor without the job's secret cannot end the job: the agent never gets past the handshake.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from unbroken.control import protocol
from unbroken.launch.agent import Agent, AgentSettings
from unbroken.wire.auth import AuthError, JobSecret, server_handshake_async


async def _scenario(run_dir: Path, secret: JobSecret, fake_secret: JobSecret) -> tuple[int | None, list[object]]:
    hellos: list[object] = []

    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            session = await server_handshake_async(reader, writer, fake_secret, protocol.PURPOSE)
        except AuthError as e:
            hellos.append(e)
            writer.close()
            return
        link = protocol.Link(reader, writer, session)
        line = await link.readline()
        assert line is not None
        hellos.append(link.decode(line))
        writer.write(session.seal_line(b"not json"))
        link.send({"op": "assign", "replicas": ["x"], "num_replicas": 1})
        link.send({"op": "assign", "replicas": [], "num_replicas": 1})
        link.send({"op": "job_finished"})
        await writer.drain()
        await reader.read()  # until the agent hangs up

    server = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret_file = run_dir.parent / "secret"
    if not secret_file.exists():
        secret.write(secret_file)
    agent = Agent(
        AgentSettings(
            command=("true",),
            coordinator=f"127.0.0.1:{port}",
            node="n0",
            run_dir=run_dir,
            finish_grace_s=0.1,
            secret_file=secret_file,
            connect_timeout_s=1.0,
        )
    )
    try:
        return await asyncio.wait_for(agent.run(), 20), hellos
    except ConnectionError:
        return None, hellos
    finally:
        server.close()


def test_a_malformed_message_is_skipped_and_the_agent_hears_the_end_of_the_job(tmp_path: Path) -> None:
    secret = JobSecret.generate()
    code, hellos = asyncio.run(_scenario(tmp_path / "run", secret, secret))
    assert code == 0
    assert isinstance(hellos[0], dict) and hellos[0]["op"] == "agent_hello" and "pid" not in hellos[0]


def test_a_coordinator_without_the_secret_cannot_end_the_job(tmp_path: Path) -> None:
    # Before, a fake `job_finished` (or a fake `hello`+`bye` at the real coordinator) made every
    # agent kill its workers and exit 0.
    code, hellos = asyncio.run(_scenario(tmp_path / "run", JobSecret.generate(), JobSecret.generate()))
    assert code is None, "the agent took orders from a coordinator that does not hold the job's secret"
    assert hellos and all(isinstance(h, AuthError) for h in hellos)


def test_the_agent_needs_the_secret(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--secret-file"):
        AgentSettings(command=("true",), coordinator="127.0.0.1:1", node="n0", run_dir=tmp_path)
