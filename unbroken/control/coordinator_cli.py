"""``unbroken coordinator``: run the coordinator on its own (multi-node jobs, or a restart).

It needs the job's secret: ``--secret-file``, or the ``secret`` file of ``--state-dir`` (made
there on first start and kept, so a coordinator restarted on the same directory takes back the
agents and workers that still run with it). Agents on other nodes get it with their own
``--secret-file``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import click

from unbroken.control import secret_file as secrets
from unbroken.control.coordinator import Coordinator, CoordinatorSettings
from unbroken.control.state_store import JOURNAL_MODES
from unbroken.wire.auth import JobSecret

# A standalone coordinator's port: a fixed one that agents and workers can be told in advance
# (the coordinator inside `unbroken run` takes any free port, CoordinatorSettings.port).
DEFAULT_PORT = 29510


async def _serve(settings: CoordinatorSettings, secret: JobSecret, secret_path: Path, http_port: int | None) -> None:
    coordinator = Coordinator(settings, secret)
    await coordinator.start()
    click.echo(f"coordinator listening on {coordinator.address}", err=True)
    server = None
    if http_port is not None:
        from unbroken.observe import http
        from unbroken.observe.live import JobView

        view = JobView(settings.state_dir, replicas=settings.total_replicas)
        status = http.on_loop(asyncio.get_running_loop(), coordinator.status)
        server = http.ObserveServer(settings.host, http_port, view, status, http.read_token(secret.key)).start()
        click.echo(f"dashboard {server.url} (metrics: /metrics, same token)", err=True)
    click.echo(f"job secret: {secret_path} (agents and workers on other nodes need it: --secret-file)", err=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
    if server is not None:
        server.close()
    await coordinator.stop()


@click.command()
@click.option("--replicas", type=int, required=True, help="Replicas the job is configured with.")
@click.option("--min-replicas", type=int, default=None, help="Fewest replicas that may train [default: a majority].")
@click.option("--host", default=CoordinatorSettings.host, show_default=True)
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--state-dir", type=click.Path(path_type=Path), default=Path("runs/coordinator"), show_default=True)
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=CoordinatorSettings.heartbeat_timeout_s,
    show_default=True,
    help="Seconds of silence before eviction.",
)
@click.option(
    "--startup-window",
    type=float,
    default=CoordinatorSettings.startup_window_s,
    show_default=True,
    help="Seconds the first quorum waits for every replica.",
)
@click.option(
    "--journal-mode",
    type=click.Choice(JOURNAL_MODES),
    default=CoordinatorSettings.journal_mode,
    show_default=True,
    help="SQLite journal of --state-dir: delete is safe on a shared filesystem; wal only on a local disk.",
)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    default=None,
    help="The job's secret (0600; `unbroken secret new PATH`) [default: $UNBROKEN_SECRET_FILE, else "
    "--state-dir/secret, made if missing].",
)
@click.option(
    "--http-port",
    type=int,
    default=None,
    help="Serve /metrics and the live dashboard on --host at this port (0: a free one) [default: none].",
)
def coordinator(
    replicas: int,
    min_replicas: int | None,
    host: str,
    port: int,
    state_dir: Path,
    heartbeat_timeout: float,
    startup_window: float,
    journal_mode: str,
    secret_file: Path | None,
    http_port: int | None,
) -> None:
    """Serve membership and quorum epochs for a job; state persists in --state-dir."""
    try:
        settings = CoordinatorSettings(
            total_replicas=replicas,
            min_replicas=min_replicas if min_replicas is not None else replicas // 2 + 1,
            state_dir=state_dir,
            host=host,
            port=port,
            heartbeat_timeout_s=heartbeat_timeout,
            startup_window_s=startup_window,
            journal_mode=journal_mode,
        )
        found = secrets.given(secret_file)
        secret, path = found if found is not None else secrets.kept(state_dir)
        asyncio.run(_serve(settings, secret, path, http_port))
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from e
