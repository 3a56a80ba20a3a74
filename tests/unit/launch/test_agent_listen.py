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
from unbroken.launch.node.agent import Agent, AgentSettings
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


def test_an_agent_leaves_a_coordinator_of_an_older_term_unheard(tmp_path: Path) -> None:
    # The new coordinator (term 3) assigns, then goes away for a moment; the agent tries the next
    # address: a replaced coordinator (term 2) that still listens, with an order to end the job
    # queued. The agent must leave it unheard, and hear the end from term 3's when it is back.
    secret = JobSecret.generate()
    said: dict[int, list[str]] = {2: [], 3: []}

    def fake(term: int, first: bool) -> object:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            session = await server_handshake_async(reader, writer, secret, protocol.PURPOSE)
            link = protocol.Link(reader, writer, session)
            line = await link.readline()
            assert line is not None
            link.send({"op": "assign", "replicas": [], "num_replicas": 1, "term": term})
            said[term].append("assign")
            if term == 2:  # queued before it stepped down: must not be acted on
                link.send({"op": "job_failed", "reason": "from a stale coordinator", "exit_code": 95})
            elif first:
                await writer.drain()
                writer.close()  # the new coordinator's connection drops (it restarts, below)
                return
            else:
                link.send({"op": "job_finished"})
            await writer.drain()
            await reader.read()

        return serve

    async def main() -> int | None:
        new = await asyncio.start_server(fake(3, True), "127.0.0.1", 0)
        old = await asyncio.start_server(fake(2, False), "127.0.0.1", 0)
        ports = [s.sockets[0].getsockname()[1] for s in (new, old)]
        secret_file = tmp_path / "secret"
        secret.write(secret_file)
        agent = Agent(
            AgentSettings(
                command=("true",),
                coordinator=f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                node="n0",
                run_dir=tmp_path / "run",
                finish_grace_s=0.1,
                secret_file=secret_file,
                connect_timeout_s=10.0,
            )
        )
        running = asyncio.ensure_future(agent.run())
        while not said[3]:
            await asyncio.sleep(0.01)
        new.close()  # gone: the agent's next connection goes to the old one
        while not said[2]:
            await asyncio.sleep(0.01)
        back = await asyncio.start_server(fake(3, False), "127.0.0.1", ports[0])
        try:
            return await asyncio.wait_for(running, 30)
        finally:
            back.close()
            old.close()

    assert asyncio.run(main()) == 0  # not 95: the stale coordinator's word was not taken
    assert len(said[2]) >= 1 and len(said[3]) >= 2
